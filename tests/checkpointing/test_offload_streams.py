"""The copy schedule of offloading on CUDA, played on the CPU through recorded stand-in streams."""

import contextlib

import torch
from torch import nn

from lightning_memopt.checkpointing import offload as offload_module
from lightning_memopt.checkpointing import offload_to_host
from lightning_memopt.checkpointing.offload_copies import StreamCopies
from lightning_memopt.private_api import TorchDispatchMode


class Event:
    def __init__(self, name):
        self.name = name


class Stream:
    """Records what is queued on it into a log shared by every stream."""

    def __init__(self, name, log):
        self.name, self.log, self.events = name, log, 0

    def wait_stream(self, stream):
        self.log.append((self.name, "waits for stream", stream.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.name))

    def record_event(self):
        self.events += 1
        event = Event(f"{self.name}{self.events}")
        self.log.append((self.name, "records", event.name))
        return event


class RecordedStreams:
    """A :class:`~lightning_memopt.checkpointing.offload_copies.CudaStreams` of stand-ins: ``out`` and ``back``
    made in that order, ``compute`` current; each copy between tensors is logged on the stream queued on."""

    def __init__(self):
        self.log = []
        self.compute = Stream("compute", self.log)
        self.made = iter(("out", "back"))
        self.active = None

    def new(self, device):
        return Stream(next(self.made), self.log)

    def current(self, device):
        return self.compute

    @contextlib.contextmanager
    def using(self, stream):
        self.active = stream
        try:
            yield
        finally:
            self.active = None

    def keep_for(self, tensor, stream):
        self.log.append((stream.name, "keeps", tuple(tensor.shape)))


class LogCopies(TorchDispatchMode):
    def __init__(self, streams):
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and self.streams.active is not None:
            self.streams.log.append((self.streams.active.name, "copies", tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def _block(x):
    return torch.sin(x * 2) * torch.cos(x * 3)  # saves four tensors of its own, none of which the next block saves


class Block(nn.Module):
    def forward(self, x):
        with offload_to_host():
            return _block(x)


def _step(transport, streams, x):
    """A forward and backward of three blocks whose copies go through ``transport``: the log, and by out-event the
    group (forward order) each copy belongs to."""
    with LogCopies(streams):
        loss = nn.Sequential(Block(), Block(), Block())(x).sum()
        forward = len(streams.log)
        groups = offload_module._live_step().schedule.live_groups()
        owner = {copy.event.name: index for index, group in enumerate(groups) for copy in group.live()}
        loss.backward()
    return streams.log[:forward], streams.log[forward:], owner


def _groups_back(backward, owner):
    """The backward's log, each entry named by the group it serves: copies back by the out-event they waited for,
    the compute's waits by the back-event they wait for."""
    back_event, waited_out, named = {}, None, []
    for stream, action, what in backward:
        if stream == "back" and action == "waits for" and what in owner:
            waited_out = owner[what]
        elif stream == "back" and action == "copies":
            named.append(("copy back", waited_out))
        elif stream == "back" and action == "records":
            back_event[what] = waited_out
        elif stream == "compute" and action == "waits for":
            named.append(("compute waits", back_event[what]))
    return named


def _recorded_transport(monkeypatch, pooled):
    """Stream copies on recorded streams, in place of CUDA's, with or without the buffer pool."""
    streams = RecordedStreams()
    transport = StreamCopies(lambda shape, dtype, pinned: torch.empty(shape, dtype=dtype), lambda: pooled, streams)
    monkeypatch.setattr(offload_module, "_transport", lambda tensor: transport)
    return streams, transport


def test_copies_go_out_and_back_on_a_stream_each_ordered_by_events(monkeypatch):
    streams, transport = _recorded_transport(monkeypatch, pooled=False)
    x = torch.randn(4, 8, requires_grad=True)
    forward, backward, owner = _step(transport, streams, x)

    # forward: each copy out on the out stream, after the compute stream, its source kept for it; an event each
    assert {entry[0] for entry in forward} == {"out"} and len(owner) == 12  # three groups of four copies
    assert forward[:4] == [
        ("out", "waits for stream", "compute"),
        ("out", "copies", (32,)),  # the storage's extent
        ("out", "keeps", (32,)),
        ("out", "records", "out1"),
    ]
    # backward: copies back on the back stream only, each after the copy out it reads; the compute never copies
    assert not any(stream == "out" for stream, _, _ in backward)
    copies_back = [index for index, entry in enumerate(backward) if entry[1] == "copies"]
    assert len(copies_back) == 12 and all(backward[i][0] == "back" for i in copies_back)
    assert all(backward[i - 1][1] == "waits for" and backward[i - 1][2] in owner for i in copies_back)
    assert backward[0] == ("back", "waits for stream", "compute")  # device memory reused from the compute stream

    # the prefetch: the last block's first unpack brings it back and then the block before it; each later block's
    # first unpack brings back the one before it, before the compute waits for any of its own tensors
    named = _groups_back(backward, owner)
    assert named[:8] == [("copy back", 2)] * 4 + [("copy back", 1)] * 4
    assert named[8:12] == [("compute waits", 2)] * 4
    assert named[12:] == [("copy back", 0)] * 4 + [("compute waits", 1)] * 4 + [("compute waits", 0)] * 4
    assert torch.equal(x.grad, torch.autograd.grad(_block(_block(_block(x))).sum(), x)[0])


def test_a_pooled_buffer_goes_out_again_only_after_its_last_copy_back(monkeypatch):
    streams, transport = _recorded_transport(monkeypatch, pooled=True)
    x = torch.randn(4, 8, requires_grad=True)
    _, first_backward, _ = _step(transport, streams, x)
    back_events = {what for stream, action, what in first_backward if stream == "back" and action == "records"}
    streams.log.clear()
    forward, _, _ = _step(transport, streams, x)
    # each buffer taken again: the out stream waits for the event of the copy back that last read it
    reused = [what for stream, action, what in forward if stream == "out" and action == "waits for"]
    assert len(reused) == 12 and set(reused) <= back_events and transport.pool.allocations == 12
