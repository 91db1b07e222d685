"""Selective recomputation by traced graphs (issue 49, item 2): the plain step's values bitwise, one trace per block
structure, no Python on the hot path, and the dispatch-mode way wherever a trace cannot follow the block."""

from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.checkpointing import traced_graph as graphs
from lightning_memopt.memory.work import KernelCounter
from lightning_memopt.planner.host import NARROW_MODELS, narrow_model
from lightning_memopt.private_api import TorchDispatchMode
from tests.helpers import keep_expensive_counted, load_benchmark

# the held-out narrow models (an IResNet and an MLP-Mixer block), added to the planner's by benchmarks/host_steps.py
HELD_OUT_MODELS = load_benchmark("host_steps").HELD_OUT_MODELS


def _selective(model: nn.Sequential) -> nn.Sequential:
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": [str(i) for i in range(len(model))], "mode": "selective"})
    return wrapped


def _steps(model: nn.Module, x: torch.Tensor, steps: int = 2, buffers: bool = True) -> list[torch.Tensor]:
    """Outputs and gradients of ``steps`` training steps on a loss whose gradient is dense (``.sum()``'s is a stride-0
    tensor, which the traced backward takes contiguous: equal within rounding, not bitwise)."""
    found = []
    for step in range(steps):
        torch.manual_seed(step)
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        found += [out.detach(), inputs.grad]
    return found + [p.grad for p in model.parameters()] + (list(model.buffers()) if buffers else [])


@pytest.mark.parametrize("name", NARROW_MODELS + HELD_OUT_MODELS)
def test_traced_selective_gives_the_plain_steps_outputs_gradients_and_running_statistics_bitwise(monkeypatch, name):
    model, x = narrow_model(name, blocks=3)
    model.train()
    wrapped = _selective(model)
    made = keep_expensive_counted(monkeypatch)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert not made  # no dispatch mode ran: the traced graphs did
    assert len(expected) == len(found)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def test_dropout_draws_its_mask_once_and_backward_uses_that_mask():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 16))
    model = nn.Sequential(*(copy.deepcopy(block) for _ in range(3)))
    x = torch.randn(4, 16)
    expected, found = _steps(model, x), _steps(_selective(model), x)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def test_bfloat16_autocast_is_traced_apart_and_matches_the_plain_step(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPHS", graphs._Graphs(graphs.GRAPHS_KEPT))
    model, x = narrow_model("transformer", blocks=2)
    wrapped = _selective(model)
    _steps(wrapped, x, steps=1)  # in fp32 first
    wrapped.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, found = _steps(model, x), _steps(wrapped, x)
    assert len(graphs.GRAPHS.entries) == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def test_blocks_of_one_structure_share_one_trace_and_another_structure_gets_its_own(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPHS", graphs._Graphs(graphs.GRAPHS_KEPT))
    model, x = narrow_model("transformer", blocks=6)
    model[5].heads = 4  # the same tensors, another forward
    wrapped = _selective(model)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))
    assert len(graphs.GRAPHS.entries) == 2


def test_the_graphs_launch_what_the_plain_step_does_plus_the_cheap_recomputation():
    """Running statistics are updated in place by the forward's batch norm (their copy back onto themselves launches
    nothing); backward recomputes batch norm and PReLU, never a convolution."""
    model, x = narrow_model("iresnet", blocks=2)
    wrapped = _selective(model)
    _steps(wrapped, x, steps=1)
    wrapped.zero_grad(set_to_none=True)
    kernels, ops = {}, {}
    for name, candidate in (("none", model), ("selective", wrapped)):
        with KernelCounter() as counter, _OpCounter() as seen:
            candidate(x.clone().requires_grad_()).square().mean().backward()
        kernels[name], ops[name] = counter.kernels, seen.counts
    assert ops["selective"]["convolution"] == ops["none"]["convolution"] == 2 * 2
    assert ops["selective"]["copy_"] == 2 * 3 * 3  # per batch norm: two statistics and the count, onto themselves
    assert ops["selective"]["_prelu_kernel"] == ops["none"]["_prelu_kernel"] + 2
    assert kernels["selective"] <= kernels["none"] + 2 * (3 + 1)  # per block: three batch norms and a PReLU again


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_copy_of_a_tensor_onto_itself_is_no_kernel():
    x = torch.ones(4)
    with KernelCounter() as counter:
        x.copy_(x)
        x.copy_(x.detach())
        x.copy_(torch.zeros(4))
    assert counter.kernels == 2  # the zeros and the last copy


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y.relu() if bool(y.sum() > 0) else y.tanh()  # control flow on a tensor's value


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)  # a buffer the forward changes, not batch norm's
        return self.linear(x).relu()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = torch.full((8,), 0.5)  # a tensor kept as a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu() * self.scale


def _hooked() -> nn.Module:
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    block[1].register_forward_hook(lambda module, args, out: out * 2)
    return block


@pytest.mark.parametrize("make", [_Gated, _Counting, _Scaled, _hooked], ids=["value", "buffer", "tensor", "hook"])
def test_what_a_trace_cannot_follow_goes_the_dispatch_mode_way_with_the_plain_steps_gradients(
    monkeypatch, make, caplog
):
    torch.manual_seed(0)
    model = nn.Sequential(make(), make())
    wrapped = _selective(model)
    made = keep_expensive_counted(monkeypatch)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger=graphs.__name__):  # a changing buffer is changed again by recomputing
        expected, found = (
            _steps(model, x, buffers=make is not _Counting),
            _steps(wrapped, x, buffers=make is not _Counting),
        )
    assert made  # the dispatch mode ran
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))
    if make in (_Gated, _Counting):  # tried and refused, said once per structure and input
        assert "by dispatch mode" in caplog.text


class _Reread(nn.Module):
    """Reads its input and its parameter several times; called twice a step on an input read after it too."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).tanh() * self.scale + x.sin() * self.scale.cos()
        return self.linear(y).sigmoid() + x * 0.3


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Reread()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.block(x)
        return self.block(first) * x.exp() + first.square()  # x and first read after the block


def _traced_entries(monkeypatch) -> graphs._Graphs:
    fresh = graphs._Graphs(graphs.GRAPHS_KEPT)
    monkeypatch.setattr(graphs, "GRAPHS", fresh)
    return fresh


def _all_traced(entries: graphs._Graphs) -> bool:
    return bool(entries.entries) and all(entry is not graphs._UNTRACEABLE for entry in entries.entries.values())


def test_a_tensor_read_several_times_inside_and_after_the_block_gets_the_plain_steps_gradient_bitwise(monkeypatch):
    """Autograd adds each reading op's gradient in turn, the latest first: the graph takes such a tensor once per
    use, latest first, instead of handing back one sum (which rounds otherwise: checked below)."""
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = _Twice()
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": ["block"], "mode": "selective"})
    x = torch.randn(16, 8)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert _all_traced(entries)
    assert all(entry.repeats for entry in entries.entries.values())  # the input, the linear and the scale, again
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))
    monkeypatch.setattr(graphs, "repeated_positions", lambda uses: [])  # one summed gradient per tensor
    summed = copy.deepcopy(model)
    apply_activation_checkpointing(summed, {"modules": ["block"], "mode": "selective"})
    entries.entries.clear()
    assert not all(torch.equal(a, b) for a, b in zip(expected, _steps(summed, x), strict=True))


class _CrossAttention(nn.Module):
    """A block of two inputs and keyword arguments: a stream and a context, a mask or none."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key_value = nn.Linear(8, 8), nn.Linear(8, 16)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, context, key_mask=None, scale=1.0):
        key, value = self.key_value(self.norm(context)).chunk(2, dim=-1)
        scores = self.query(x) @ key.transpose(-2, -1) * scale
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, :], float("-inf"))
        return x + scores.softmax(-1) @ value


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _CrossAttention(), _CrossAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.flip(1).tanh()
        mask = torch.arange(x.shape[1]) % 3 != 0
        y = self.first(x, context, key_mask=mask.expand(x.shape[0], -1), scale=0.5)
        return self.second(y, context) + context.mean()  # the context read by both blocks and after them


def test_a_block_of_several_inputs_and_keywords_is_traced_and_matches_the_plain_step(monkeypatch):
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = _Attending()
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": ["first", "second"], "mode": "selective"})
    x = torch.randn(2, 6, 8)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert _all_traced(entries) and len(entries.entries) == 2  # with a mask and a scale, and without
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


class _Upsampling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.interpolate(self.conv(x).relu(), scale_factor=2, mode="bilinear", align_corners=True)
        return nn.functional.interpolate(y, size=x.shape[-2:], mode="nearest") + x


def test_an_upsampling_is_traced_whole_and_differentiated_by_its_formula(monkeypatch):
    """Tracing runs under the Python dispatcher, whose upsampling decompositions sum their backward otherwise: the
    trace keeps the op whole (one kernel, as the plain step) and puts the decompositions back afterwards."""
    entries = _traced_entries(monkeypatch)
    kernels_before = dict(torch.ops.aten.upsample_bilinear2d.default.py_kernels)
    torch.manual_seed(0)
    model = nn.Sequential(_Upsampling(), _Upsampling())
    wrapped = _selective(model)
    x = torch.randn(2, 3, 8, 8)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert _all_traced(entries)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))
    assert torch.ops.aten.upsample_bilinear2d.default.py_kernels == kernels_before
    with _OpCounter() as seen:
        wrapped(x.clone().requires_grad_()).square().mean().backward()
    assert seen.counts["upsample_bilinear2d"] == 2 and seen.counts["upsample_bilinear2d_backward"] == 2
    assert seen.counts["_unsafe_index"] == 0


def test_one_tensor_passed_twice_goes_the_dispatch_mode_way_with_the_plain_steps_gradients(monkeypatch):
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential()
    model.block = _CrossAttention()
    model.forward = lambda x: model.block(x, x)
    wrapped = copy.deepcopy(model)
    wrapped.forward = lambda x: wrapped.block(x, x)
    apply_activation_checkpointing(wrapped, {"modules": ["block"], "mode": "selective"})
    x = torch.randn(2, 6, 8)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert not entries.entries  # never traced
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def _full(model: nn.Sequential) -> nn.Sequential:
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": [str(i) for i in range(len(model))], "mode": "full"})
    return wrapped


@pytest.mark.parametrize("name", NARROW_MODELS + HELD_OUT_MODELS)
def test_traced_full_recomputation_gives_the_plain_steps_values_bitwise(monkeypatch, name):
    entries = _traced_entries(monkeypatch)
    model, x = narrow_model(name, blocks=3)
    model.train()
    wrapped = _full(model)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert _all_traced(entries)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def test_full_recomputation_stops_at_the_last_op_backward_needs():
    """A transformer block's backward needs its fc2's input, not its output: fc2 (and the residual add after it) is
    not run again, nor is a residual block's last addition; everything before them is."""
    for name, op, again in (("transformer", "addmm", 3), ("iresnet", "convolution", 2)):
        model, x = narrow_model(name, blocks=2)
        model.train()
        wrapped = _full(model)
        _steps(wrapped, x, steps=1)
        counts = {}
        for label, candidate in (("none", model), ("full", wrapped)):
            with _OpCounter() as seen:
                candidate(x.clone().requires_grad_()).square().mean().backward()
            counts[label] = seen.counts
        assert counts["full"][op] - counts["none"][op] == again * 2, name


class _Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.linear(x).relu()) + x


def test_a_block_drawing_random_numbers_is_recomputed_eagerly_under_full(monkeypatch, caplog):
    """Saving what it drew would keep more than its inputs: the eager recomputation redraws it instead."""
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(_Dropping(), _Dropping())
    wrapped, x = _full(model), torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger=graphs.__name__):
        expected, found = _steps(model, x), _steps(wrapped, x)
    assert "full checkpointing of _Dropping untraced" in caplog.text
    assert set(entries.entries.values()) == {graphs._UNTRACEABLE}
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.second.weight = self.first.weight  # one parameter under two names: the second is not a slot of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).tanh()) + x


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_tensors_the_forward_reaches_outside_its_slots_stop_the_trace_and_keep_their_gradients(monkeypatch, mode):
    """A trace would hold them as constants: the tied weight would take the gradient of one of its uses only."""
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(_Tied())
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": ["0"], "mode": mode})
    x = torch.randn(4, 8)
    expected, found = _steps(model, x), _steps(wrapped, x)
    assert set(entries.entries.values()) == {graphs._UNTRACEABLE}
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


class _Signed(nn.Module):
    def __init__(self, negative: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self._negative = negative  # a private attribute the forward reads: part of the structure

    def forward(self, x: torch.Tensor, scale=1.0) -> torch.Tensor:
        y = self.linear(x).tanh() * scale
        return -y if self._negative else y


def test_private_attributes_argument_types_and_replaced_modules_each_get_their_own_trace(monkeypatch):
    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(_Signed(False), _Signed(True))
    wrapped = _full(model)
    x = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(_steps(model, x), _steps(wrapped, x), strict=True))
    assert len(entries.entries) == 2  # the sign is part of the structure
    for block, plain in zip(wrapped, model, strict=True):  # 1 and 1.0 differ to a trace: an int scale stays exact
        inputs = torch.arange(8, dtype=torch.float64).reshape(1, 8).requires_grad_()
        block.linear.double(), plain.linear.double()
        assert torch.equal(block(inputs, scale=1), plain(inputs, scale=1))
        assert torch.equal(block(inputs, scale=1.0), plain(inputs, scale=1.0))
    replaced = nn.Linear(8, 8).double()
    wrapped[0].linear, model[0].linear = replaced, copy.deepcopy(replaced)
    inputs = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    wrapped[0](inputs).sum().backward()
    assert replaced.weight.grad is not None  # the new module's parameters are the graph's, not the old one's


def test_a_block_structure_is_traced_for_a_bounded_number_of_input_shapes(monkeypatch, caplog):
    entries = _traced_entries(monkeypatch)
    monkeypatch.setattr(graphs, "TRACED_SHAPES", {})
    monkeypatch.setattr(graphs, "SHAPES_TRACED", 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, {"modules": ["0"], "mode": "full"})
    with caplog.at_level(logging.INFO, logger=graphs.__name__):
        for rows in (2, 3, 4, 5):
            x = torch.randn(rows, 8)
            assert all(torch.equal(a, b) for a, b in zip(_steps(model, x, 1), _steps(wrapped, x, 1), strict=True))
    assert len(entries.entries) == 2
    assert caplog.text.count("2 of its input shapes are traced, not more") == 1


def test_a_block_carrying_fsdp2s_state_is_traced(monkeypatch):
    """``fully_shard`` keeps its state in the ``__dict__`` of the modules it shards, under names made at import: the
    forward never reads it, so it is no part of the block's structure (it stopped the trace under FSDP2)."""
    from torch.distributed._composable import contract

    @contract()
    def carrying_state(module: nn.Module) -> nn.Module:  # what fully_shard and replicate do first
        return module

    entries = _traced_entries(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), carrying_state(nn.Linear(8, 8)))
    carrying_state(model[0][0])
    wrapped = _full(model)
    x = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(_steps(model, x), _steps(wrapped, x), strict=True))
    assert _all_traced(entries) and len(entries.entries) == 2
