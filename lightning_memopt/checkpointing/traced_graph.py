"""Recomputation without per-op Python: a block traced once into a forward and a backward graph.

:class:`~lightning_memopt.checkpointing.selective.KeepExpensive` tells a block's expensive ops from its cheap ones
by calling Python for every op, in the forward and again in the recomputation: on a host-bound step that costs more
than the kept ops save. Here a block is traced once (AOTAutograd, on fake tensors) into the joint graph of its
forward and backward aten ops; the outputs of :data:`~lightning_memopt.checkpointing.selective.SAVED_OPS` and of
random ops are tagged to be saved, every other op to be recomputed, and the min-cut partitioner splits the graph in
two (:mod:`~lightning_memopt.checkpointing.traced_partition`): a forward that returns what backward needs, a
backward that recomputes the cheap ops and computes the gradients. Both run as plain aten calls inside one autograd
node: no dispatch mode, no saved-tensor hook. Full recomputation is traced alike, every forward op tagged to be
recomputed: the forward saves the block's inputs alone, and backward recomputes only the ops it needs (not a
transformer block's fc2 and the residual addition after it, whose outputs no gradient needs); a block that draws
random numbers is recomputed eagerly instead (saving what it drew would keep more than its inputs). Batch norm
updates its running statistics in place in the forward and is recomputed from the batch's statistics. The outputs,
gradients and running statistics equal the unchecked block's bitwise on the CPU where the output's gradient is a
dense tensor (tested): a tensor read more than once takes one stand-in per use
(:mod:`~lightning_memopt.checkpointing.traced_uses`), and the ops whose derivative tracing would take from a
Python decomposition (upsampling, dropout) are traced whole.

One trace serves every block of one structure (class, the attributes of the modules inside, the shapes of
parameters, buffers and input tensors, the call's other arguments, autocast): parameters and buffers are the graph's
inputs. What a trace cannot follow is not traced and goes the way it went before (the dispatch mode for selective,
the eager recomputation for full: :meth:`TracedGraph.run` returns ``None``): hooks or instance forwards on
modules inside the block, tensors kept as plain attributes, attributes or arguments that no key can compare, one
tensor passed twice, a buffer changed in the forward other than batch norm's statistics, or control flow on tensor
values. A forward's Python side effects happen when it is traced (three times, on fake tensors: once to count its
reads, twice in AOTAutograd). A block structure is traced for at most :data:`SHAPES_TRACED` input shapes; its
other shapes go the untraced way (tracing takes about a second).

Example::

    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> out = TracedGraph(block).run(block.forward, (x,))
    >>> out.sum().backward()
    >>> expected = torch.autograd.grad(block(x).sum(), x)[0]
    >>> torch.equal(x.grad, expected)
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing.traced_key import (
    autocast_state,
    block_structure,
    call_form,
    rebuild_call,
    tensor_metas,
)
from lightning_memopt.checkpointing.traced_partition import recompute_partition
from lightning_memopt.checkpointing.traced_uses import UseRouter, repeated_positions, stand_ins_by_use
from lightning_memopt.memory.autocast_lists import active_lists
from lightning_memopt.private_api import (
    FakeTensorMode,
    contiguous_tangents,
    decomposed_derivatives,
    differentiated_by_formula,
    disable_current_modes,
    has_hooks,
    is_batch_norm,
    reparametrized,
    tensor_slots,
    tensor_version,
    trace_forward_and_backward,
    tree_flatten,
)

log = logging.getLogger(__name__)

GRAPHS_KEPT = 256  # traced graphs kept in this process (the least recently used go first)
_UNTRACEABLE = object()  # a key whose trace failed: the untraced way, without trying again
SHAPES_TRACED = 16  # input shapes of one block structure traced before its new ones go the untraced way


class _Graphs:
    """The traced graphs of this process, by structure and inputs; :data:`_UNTRACEABLE` where tracing failed."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self.entries: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, key: tuple) -> Any:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple, entry: Any) -> None:
        self.entries[key] = entry
        while len(self.entries) > self.kept:
            self.entries.popitem(last=False)


GRAPHS = _Graphs(GRAPHS_KEPT)


class TracedGraph:
    """One checkpointed block's way to its traced graphs. Its structure (the modules inside, their attributes, where
    its parameters and buffers live) is read on its first call; each call reads the tensors, training flags and
    hooks again.

    Example::

        >>> graph = TracedGraph(torch.nn.Linear(2, 2))
        >>> graph.run(graph.module.forward, (torch.ones(1, 2, requires_grad=True),)).shape
        torch.Size([1, 2])
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.structure: int | None = None  # the structure's number in this process; None: untraceable
        self.modules: list[nn.Module] = []  # as last read; none before the first call
        self.names: list[str] = []  # of its parameters, then its buffers
        self.slots: list[tuple[dict[str, Any], str]] = []  # where each of those lives: (a module's dict, key)

    def run(
        self,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        mode: str = "selective",
    ) -> Any:
        """``forward(*args, **kwargs)`` by the block's traced graphs, recomputing in backward its cheap ops
        (``mode="selective"``) or every op backward needs (``"full"``); ``None`` where the block cannot be traced
        (then nothing ran)."""
        modules = list(self.module.modules())
        if len(modules) != len(self.modules) or any(map(operator.is_not, modules, self.modules)):
            self._read(modules)  # on the first call, and again where a module inside was added or replaced since
        if self.structure is None or any(map(has_hooks, modules[1:])):
            return None
        call = call_form(args, kwargs)
        if call is None:
            return None
        inputs, form = call
        try:
            tensors = (*(members[name] for members, name in self.slots), *inputs)
        except KeyError:  # a parameter moved since (a parametrization registered): read again
            self._read(modules)
            return None
        lists = active_lists()
        training = tuple(module.training for module in self.modules)
        key = (
            mode,
            self.structure,
            training,
            tensor_metas(tensors),
            autocast_state(tensors),
            lists and lists.dtype,
            form,
        )
        try:
            graph = GRAPHS.get(key)
        except TypeError:  # an argument that compares but does not hash: no key for it
            return None
        if graph is None:
            shapes = TRACED_SHAPES.setdefault((mode, self.structure), set())
            shape = tuple(t.shape for t in inputs)  # a fake profile's and the real step's count once
            if shape not in shapes and len(shapes) >= SHAPES_TRACED:
                if len(shapes) == SHAPES_TRACED:
                    _refused(self.module, mode, f"{SHAPES_TRACED} of its input shapes are traced, not more")
                    shapes.add(None)  # said once
                return None
            shapes.add(shape)
            graph = _trace(self.module, forward, self.names, tensors, form, mode)
            GRAPHS.put(key, graph)
        return None if graph is _UNTRACEABLE else graph(tensors)

    def _read(self, modules: list[nn.Module]) -> None:
        self.modules, self.names, self.slots = modules, [], []
        structure = block_structure(self.module)
        self.structure = None if structure is None else _STRUCTURES.setdefault(structure, len(_STRUCTURES))
        if structure is None:
            return
        for name, members, key in tensor_slots(self.module):
            self.names.append(name)
            self.slots.append((members, key))


_STRUCTURES: dict[tuple, int] = {}  # each block structure seen in this process, numbered
TRACED_SHAPES: dict[tuple[str, int], set] = {}  # input shapes traced, by mode and structure (a second or so each)


class _Traced:
    """A block's traced graphs, and which of its tensors they take once more per extra use (see
    :mod:`~lightning_memopt.checkpointing.traced_uses`)."""

    def __init__(self, graph: Callable[..., Any], repeats: list[int]) -> None:
        self.graph = graph
        self.repeats = repeats

    def __call__(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        if not self.repeats:
            return self.graph(*tensors)
        return self.graph(*tensors, *(tensors[position] for position in self.repeats))


def _trace(
    module: nn.Module, forward: Callable[..., Any], names: list[str], tensors: tuple, form: Any, mode: str
) -> Any:
    """The traced graphs of ``forward`` on tensors shaped as ``tensors`` (state first) and called as ``form`` says,
    partitioned for ``mode``, or :data:`_UNTRACEABLE`."""
    source: list[Any] = [module, forward]  # what the trace reads, let go once traced
    count = len(tensors)
    repeats: list[int] = []  # known from the first run, before the trace

    def block(*flat: torch.Tensor) -> Any:
        traced_module, traced_forward = source
        routes = stand_ins_by_use(flat, count, repeats)
        routed = UseRouter(routes) if routes else contextlib.nullcontext()
        with reparametrized(traced_module, dict(zip(names, flat[: len(names)], strict=True))), routed:
            args, kwargs = rebuild_call(form, flat[len(names) : count])
            return traced_forward(*args, **kwargs)

    tracked = _batch_norm_counters(module)
    counters = {f"primals_{i + 1}" for i, name in enumerate(names) if name in tracked}
    partition = functools.partial(recompute_partition, counters=counters, mode=mode)
    graph = trace_forward_and_backward(block, partition, len(names))
    try:
        with disable_current_modes():  # what watches the step sees the graphs run, not their tracing
            fake_mode = FakeTensorMode()  # a real tensor the forward reaches (a tied weight, say) stops the trace
            stand_ins = _fake_copies(fake_mode, tensors)
            uses = _first_run(block, stand_ins, fake_mode)
            repeats += repeated_positions(uses)
            extra = _fake_extras(fake_mode, [stand_ins[position] for position in repeats])
            versions = [tensor_version(t) for t in stand_ins]
            # tensors the forward makes are fake too; ops the plain step differentiates by formula, so does the trace
            with torch.enable_grad(), fake_mode, differentiated_by_formula(_by_their_formulas()), contiguous_tangents():
                output = graph(*stand_ins, *extra)
            _compile_backward(output, fake_mode)
    except Exception as error:  # noqa: BLE001 - whatever stops the tracer, the untraced way serves
        return _refused(module, mode, f"it cannot be traced ({error})")
    finally:
        source.clear()
    changed = {name for name, t, v in zip(names, stand_ins, versions, strict=False) if tensor_version(t) != v}
    others = sorted(changed - _batch_norm_statistics(module) - tracked)
    if others:  # its recomputation could read them changed
        return _refused(module, mode, f"its forward changes {others}")
    return _Traced(graph, repeats)


def _compile_backward(output: Any, fake_mode: FakeTensorMode) -> None:
    """Run the traced backward once on fake gradients, outside any mode: AOTAutograd builds it on its first call, by
    copying the graph, whose constants (real tensors made by the forward, ``torch.tensor([...])``) a fake mode cannot
    copy; nor should the step's modes see it. Those constants then meet fake tensors."""
    outs = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    fake_mode.allow_non_fake_inputs = True
    if outs:
        torch.autograd.backward(outs, [torch.zeros_like(out) for out in outs])


def _first_run(
    block: Callable[..., Any], stand_ins: tuple[torch.Tensor, ...], fake_mode: FakeTensorMode
) -> dict[int, int]:
    """``block`` run once on ``stand_ins``, as the plain step runs it: how often it reads each tensor that needs
    gradients, by position."""
    needing = {id(t): position for position, t in enumerate(stand_ins) if t.requires_grad}
    with torch.enable_grad(), fake_mode, UseRouter(dict.fromkeys(needing)) as router:
        block(*stand_ins)
    return {position: router.uses[key] for key, position in needing.items()}


def _by_their_formulas() -> list[Any]:
    """The operators a trace differentiates by their own formulas, as the plain step does: those PyTorch's tracing
    would decompose, batch norm aside (its traced graph runs the functional batch norm that the partition rewrites,
    bitwise the plain step's on the CPU)."""
    batch_norms = (torch.ops.aten.native_batch_norm, torch.ops.aten.cudnn_batch_norm)
    return [op for op in decomposed_derivatives() if op.overloadpacket not in batch_norms]


def _refused(module: nn.Module, mode: str, why: str) -> Any:
    way = "by dispatch mode" if mode == "selective" else "untraced"
    log.info("%s checkpointing of %s %s: %s", mode, type(module).__name__, way, why)
    return _UNTRACEABLE


def _fake_extras(fake_mode: FakeTensorMode, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stand-in of its own beside each of ``tensors`` (which are ``fake_mode``'s), shaped and strided alike."""
    with fake_mode:
        return [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_() for t in tensors
        ]


def _fake_copies(fake_mode: FakeTensorMode, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Stand-ins to trace on, in a fake mode of their own (gradient flags kept): the trace keeps what it ran on, and
    nothing of the step's own, fake or real, may stay alive by it."""
    return tuple(fake_mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in tensors)


def _batch_norm_statistics(module: nn.Module, names: tuple[str, ...] = ("running_mean", "running_var")) -> set[str]:
    """The buffers of ``module``'s batch norms that their forward in training updates: their running statistics."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, inner in module.named_modules()
        if is_batch_norm(inner)
        for name in names
    }


def _batch_norm_counters(module: nn.Module) -> set[str]:
    """The ``num_batches_tracked`` of ``module``'s batch norms."""
    return _batch_norm_statistics(module, ("num_batches_tracked",))
