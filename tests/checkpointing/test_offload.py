import gc

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import (
    MIN_OFFLOAD_BYTES,
    PinnedBufferPool,
    PrefetchSchedule,
    offload_stats,
    offload_to_host,
    release_offload_buffers,
)
from lightning_memopt.checkpointing import offload as offload_module
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.private_api import FakeTensorMode, TorchDispatchMode


class Block(nn.Module):
    """Ends in tanh (which saves its output); the next block's norm saves the same tensor as its input."""

    def __init__(self, width: int, offload: bool) -> None:
        super().__init__()
        self.offload = offload
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        if not self.offload:
            return self._forward(x)
        with offload_to_host():
            return self._forward(x)

    def _forward(self, x):
        a, b, c = self.up(self.norm(x)).unflatten(-1, (3, -1)).unbind(-2)  # views with gaps of one storage
        return torch.tanh(x + self.down(a.sin() * b.sigmoid() + c.cos()))


def _model(offload: bool, depth: int = 4, width: int = 16, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, offload) for _ in range(depth))).to(device)


def _gradients(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    loss = model(x).square().sum()
    loss.backward()
    return x.grad, [p.grad for p in model.parameters()]


def test_several_offloaded_blocks_give_the_gradients_of_none_bitwise():
    x = torch.randn(2, 5, 16)
    expected_input, expected = _gradients(_model(offload=False), x)
    got_input, got = _gradients(_model(offload=True), x)
    assert torch.equal(expected_input, got_input)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_nothing_outlives_the_backward_pass():
    model = _model(offload=True)
    tracker = MemoryTracker()
    gc.disable()  # freed by reference counts alone: no cycle keeps a step alive
    try:
        with tracker:
            loss = model(torch.randn(2, 5, 16, requires_grad=True)).sum()
            during = offload_stats()
            loss.backward()
            del loss
        after = offload_stats()
    finally:
        gc.enable()
    assert during.groups == 4 and during.host_copies > 0 and during.host_bytes == tracker.peak_host_bytes
    assert (after.groups, after.host_copies, after.host_bytes) == (0, 0, 0)
    assert tracker.host_bytes == 0 and offload_module._live_step() is None  # the step itself is gone


def test_a_graph_dropped_without_backward_releases_its_copies():
    loss = _model(offload=True)(torch.randn(2, 5, 16, requires_grad=True)).sum()
    assert offload_stats().groups == 4
    del loss
    assert offload_stats().groups == 0


def test_a_tensor_saved_twice_is_copied_once_even_across_blocks():
    x = torch.randn(8, 16, requires_grad=True)
    y = x.exp()
    (y.sin() + y.cos()).sum().backward()
    expected, x.grad = x.grad, None
    tracker = MemoryTracker()
    with tracker:
        with offload_to_host():
            y = x.exp()  # saves its output y
        with offload_to_host():
            z = y.sin() + y.cos()  # both save their input y
        stats = offload_stats()
    assert (stats.groups, stats.host_copies, stats.host_bytes) == (2, 1, 8 * 16 * 4)
    assert tracker.peak_host_bytes == 8 * 16 * 4
    z.sum().backward()
    assert torch.equal(x.grad, expected)


def test_views_of_one_storage_share_one_copy_and_come_back_with_their_strides():
    base = torch.randn(4, 3, 8, requires_grad=True) * 1  # a storage of its own
    q, k, v = base.unbind(1)  # (4, 8) views with strides (24, 1), at offsets 0, 8 and 16
    with offload_to_host():
        out = [q.sin(), k.sin(), v.sin()]
    stats = offload_stats()
    assert (stats.host_copies, stats.host_bytes) == (1, 4 * 3 * 8 * 4)  # the storage, once
    for view, result in zip((q, k, v), out, strict=True):
        saved = result.grad_fn._saved_self  # unpacked
        assert (saved.shape, saved.stride()) == (view.shape, view.stride())
        assert saved.storage_offset() == view.storage_offset()
        assert torch.equal(saved, view)


def test_a_sparse_view_of_a_large_storage_is_copied_compactly():
    wide = torch.randn(4, 64, requires_grad=True) * 1
    column = wide[:, :2]  # 8 elements spread over 194
    with offload_to_host():
        out = column.sin()
    assert offload_stats().host_bytes == 8 * 4
    saved = out.grad_fn._saved_self
    assert saved.shape == column.shape and saved.is_contiguous() and torch.equal(saved, column)
    out.sum().backward()


def test_a_dense_view_keeps_its_offset_and_copies_from_an_aligned_start():
    base = torch.randn(4, 64, requires_grad=True) * 1
    rows = base[1:]  # offset 64 elements (256 bytes): the copy starts at 0, a multiple of 512 bytes
    with offload_to_host():
        out = rows.sin()
    assert offload_stats().host_bytes == 4 * 64 * 4
    saved = out.grad_fn._saved_self
    assert (saved.storage_offset(), saved.stride()) == (64, rows.stride()) and torch.equal(saved, rows)


def test_a_tensor_changed_in_place_is_copied_again():
    x = torch.randn(32, requires_grad=True)

    def forward():
        a = x * 1
        kept = a.sin()  # saves a at version 0 (its backward never runs)
        a.mul_(2)
        return a.cos().sum(), kept  # saves a at version 1

    forward()[0].backward()
    expected, x.grad = x.grad, None
    with offload_to_host():
        loss, kept = forward()
    assert offload_stats().host_copies == 2
    loss.backward()
    assert torch.equal(x.grad, expected)


def test_what_offloading_leaves_in_place():
    weight = nn.Parameter(torch.randn(8, 8))

    class SavesSparse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x.detach().to_sparse())
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (sparse,) = ctx.saved_tensors
            assert sparse.is_sparse
            return grad * 2

    x = torch.randn(4, 8, requires_grad=True)
    with offload_to_host():
        out = SavesSparse.apply(x @ weight.t()) + torch.empty(0, 8, requires_grad=True).sin().sum()
    assert offload_stats().host_bytes == 4 * 8 * 4  # x alone: not the weight's view, the sparse or the empty tensor
    out.sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones(4, 8) @ weight)


def test_the_minimum_size_spares_cpu_tensors_and_is_checked():
    x = torch.randn(16, requires_grad=True)
    with offload_to_host(min_bytes=MIN_OFFLOAD_BYTES):
        y = x.sin()
    assert offload_stats().host_bytes == 64  # a CPU run counts every saved tensor, whatever the minimum
    del y
    with pytest.raises(ValueError, match=r"`min_bytes` must be an integer ≥ 0, got -1"):
        offload_to_host(min_bytes=-1)
    with pytest.raises(TypeError, match=r"`min_bytes` must be an integer ≥ 0, got '1MB' \(str\)"):
        offload_to_host(min_bytes="1MB")


def test_fake_tensors_are_offloaded_as_real_ones_are_counted():
    with FakeTensorMode():
        x = torch.empty(64, 64, requires_grad=True)
        tracker = MemoryTracker()
        with tracker, offload_to_host():
            y = x.sin().sum()
        y.backward()
    assert tracker.peak_host_bytes == 64 * 64 * 4 and tracker.host_bytes == 0


def test_backward_fetches_each_group_and_the_one_before_it_once(monkeypatch):
    added, started = [], []
    add, first_unpack = PrefetchSchedule.add, PrefetchSchedule.first_unpack

    def recording_add(schedule, group):
        added.append(group)
        add(schedule, group)

    def recording_first_unpack(schedule, group):
        due = first_unpack(schedule, group)
        started.append([added.index(g) for g in due])
        return due

    monkeypatch.setattr(PrefetchSchedule, "add", recording_add)
    monkeypatch.setattr(PrefetchSchedule, "first_unpack", recording_first_unpack)
    loss = _model(offload=True)(torch.randn(2, 5, 16)).sum()
    assert len(added) == 4 and started == []  # the forward fetches nothing
    loss.backward()
    assert [due for due in started if due] == [[3, 2], [1], [0]]  # the last block first, one block ahead


def test_the_schedule_passes_over_released_groups_and_refuses_strangers():
    class Group:
        pass

    schedule = PrefetchSchedule()
    groups = [Group() for _ in range(3)]
    for group in groups:
        schedule.add(group)
    del groups[1]  # its tensors were released (or it offloaded nothing)
    assert schedule.first_unpack(groups[1]) == [groups[1], groups[0]]
    assert schedule.first_unpack(groups[0]) == []  # started already, and the first
    assert schedule.live_groups() == groups
    with pytest.raises(KeyError):
        schedule.first_unpack(Group())
    before, after = Group(), Group()
    schedule.add(before)
    for _ in range(1000):  # a step kept alive (a graph never run) while other blocks come and go
        schedule.add(Group())
    schedule.add(after)
    assert len(schedule) < 200 and schedule.live_groups() == [*groups, before, after]
    assert schedule.first_unpack(after) == [after, before]


class RecordingStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_the_pool_reuses_by_size_and_orders_reuse_after_the_last_copy():
    pool = PinnedBufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    stream = RecordingStream()
    first = pool.take(1000, stream)
    assert first.numel() == 1024 and pool.allocations == 1
    pool.give_back(first, event="copy done")
    assert pool.take(700, stream) is first and stream.waited == ["copy done"]
    assert pool.allocations == 1 and (pool.in_use_bytes, pool.idle_bytes) == (1024, 0)


def test_the_pool_holds_no_more_than_it_ever_had_in_use():
    pool = PinnedBufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    small = [pool.take(512, None) for _ in range(4)]  # 2 KiB in use at most
    for buffer in small:
        pool.give_back(buffer, None)
    large = pool.take(1536, None)  # a new size: idle buffers make room, 2 KiB held in all
    assert pool.most_in_use_bytes == 2048 and pool.idle_bytes + pool.in_use_bytes == 2048
    pool.give_back(large, None)
    assert pool.release() == 2048 and pool.idle_bytes == 0
    assert release_offload_buffers() == 0  # the process-wide pool: nothing pinned on a CPU machine


# -- CUDA: side stream, events, pinned buffers ------------------------------------------------------------------
def _cuda_step(model, x):
    x = x.clone().requires_grad_()
    loss = model(x).square().mean()
    churn = [torch.full_like(x, float(i)) for i in range(8)]  # reuses memory freed in the forward, before its copy
    loss.backward()
    del churn
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.cuda
def test_cuda_offload_gives_the_gradients_of_none_and_reuses_its_pinned_buffers():
    x = torch.randn(64, 256, 512, device="cuda")  # 32 MiB activations, several per block
    expected = _cuda_step(_model(offload=False, width=512, device="cuda"), x)
    model = _model(offload=True, width=512, device="cuda")
    got = _cuda_step(model, x)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    allocations, pinned = offload_stats().pinned_allocations, torch.cuda.host_memory_stats()["num_host_alloc"]
    assert allocations > 0
    model.zero_grad()
    again = _cuda_step(model, x)
    assert all(torch.equal(e, g) for e, g in zip(expected, again, strict=True))
    stats = offload_stats()
    assert stats.pinned_allocations == allocations and torch.cuda.host_memory_stats()["num_host_alloc"] == pinned
    assert (stats.groups, stats.host_copies) == (0, 0) and stats.pooled_bytes > 0
    assert release_offload_buffers() == stats.pooled_bytes and offload_stats().pooled_bytes == 0


class CopyStreams(TorchDispatchMode):
    """The CUDA stream current at each copy between host and device."""

    def __init__(self):
        super().__init__()
        self.streams = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
            self.streams.append(torch.cuda.current_stream())
        return func(*args, **(kwargs or {}))


@pytest.mark.cuda
def test_cuda_copies_run_on_a_side_stream_each_way_and_small_tensors_stay():
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)  # 4 MiB
    small = torch.randn(16, device="cuda", requires_grad=True)
    recorder = CopyStreams()
    with recorder:
        with offload_to_host():
            loss = x.sin().sum() + small.sin().sum()
        assert offload_stats().host_copies == 1  # the small one stays on the device
        loss.backward()
    assert len(recorder.streams) == 2 and recorder.streams[0] != recorder.streams[1]  # there and back, a stream each
    assert all(stream != torch.cuda.default_stream() for stream in recorder.streams)
    assert torch.equal(x.grad, x.detach().cos()) and torch.equal(small.grad, small.detach().cos())
    with offload_to_host(min_bytes=0):
        y = small.sin()
    assert offload_stats().host_copies == 1
    del y


@pytest.mark.cuda
def test_cuda_views_share_a_copy_and_a_tracker_sees_every_pinned_buffer():
    base = torch.randn(256, 3, 1024, device="cuda", requires_grad=True) * 1
    q, k, v = base.unbind(1)
    pool_before = offload_stats().pinned_allocations
    tracker = MemoryTracker()
    with tracker:
        with offload_to_host():
            out = q.sin() + k.sin() + v.sin()
        assert offload_stats().host_copies == 1
        saved = out.grad_fn.next_functions[0][0].next_functions[1][0]._saved_self  # k.sin()'s input, unpacked
        assert (saved.stride(), saved.storage_offset()) == (k.stride(), k.storage_offset())
        out.sum().backward()
    assert tracker.peak_host_bytes == base.nbytes and tracker.host_bytes == 0
    assert offload_stats().pinned_allocations == pool_before  # not pooled while a tracker counts


@pytest.mark.cuda
def test_cuda_fake_tensors_copy_at_once_and_keep_small_ones():
    with FakeTensorMode():
        x = torch.empty(1024, 1024, device="cuda", requires_grad=True)
        small = torch.empty(16, device="cuda", requires_grad=True)
        tracker = MemoryTracker()
        with tracker, offload_to_host():
            y = x.sin().sum() + small.sin().sum()
        y.backward()
    assert tracker.peak_host_bytes == x.nbytes and x.grad.device.type == "cuda"
