"""A compiled training step's activation memory, predicted without running it: the graphs torch.compile would run.

``torch.compile`` traces the forward and backward of a step into one joint graph and splits it with the min-cut
partitioner, which reads functorch's ``activation_memory_budget``: what the forward graph returns
beside the loss is what the backward keeps. :func:`predict_compiled_step` traces the same joint graph on fake
tensors (AOTAutograd, as ``torch.compile`` does beneath dynamo), partitions it at the budget asked, and walks both
graphs in order: each op's output is allocated (a view takes nothing new), and freed after its last use; what the
forward hands the backward stays until the backward's last use of it; the backward's gradients stay to its end.
The largest total above the step's start (weights, the batch and anything else already there) is the peak.

This is the graph's own memory, as the ``aot_eager`` backend runs it op by op. Inductor fuses pointwise ops and
reuses buffers, so its peak is at most this, bar a kernel's scratch memory.

Example::

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    >>> loss = lambda model, x: model(x).square().mean()
    >>> kept, recomputed = (predict_compiled_step(net, torch.randn(32, 64), loss, budget) for budget in (1.0, 0.0))
    >>> kept.saved_bytes > recomputed.saved_bytes, kept.peak_bytes >= recomputed.peak_bytes
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.step_parts import materialise
from lightning_memopt.private_api import (
    FakeTensorMode,
    activation_memory_budget,
    compile_decompositions,
    is_fake,
    min_cut_partition,
    reparametrized,
    storage_key,
    trace_forward_and_backward,
    tree_flatten,
    tree_unflatten,
)


@dataclass(frozen=True)
class CompiledStepPeak:
    """The memory of one compiled forward and backward above the step's start, in bytes.

    ``saved_bytes``: what the forward graph leaves for the backward (the partitioner's choice at ``budget``);
    ``after_forward``: all the forward leaves (the loss and the saved); ``forward_peak`` / ``backward_peak``: the
    largest total in each graph; ``peak_bytes``: the larger; ``gradient_bytes``: the gradients the backward returns.
    """

    budget: float
    saved_bytes: int
    after_forward: int
    forward_peak: int
    backward_peak: int
    gradient_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def predict_compiled_step(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget: float = 1.0,
    precision: str = "32-true",
) -> CompiledStepPeak:
    """The activation memory of ``loss_fn(model, batch).backward()`` compiled with ``activation_memory_budget=budget``.

    ``model`` (or the module a factory builds) and ``batch`` are copied onto fake tensors: nothing is allocated or
    run. ``budget`` as torch.compile takes it: 1.0 saves what the runtime-optimal cut saves, 0.0 recomputes the
    whole forward from its inputs. ``precision``: a ``-mixed`` one traces the step under autocast to its half type
    (the casts are in the graph); ``-true`` ones other than fp32 are not modelled and raise.
    """
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"`budget`={budget!r} must be within [0, 1] (torch's activation_memory_budget)")
    half = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0])
    if precision != "32-true" and not (precision.endswith("-mixed") and half is not None):
        raise ValueError(f"`precision`={precision!r}: a compiled step is predicted at 32-true, bf16-mixed or 16-mixed")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    module = materialise(model, fake_mode)
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    names = list(state)
    leaves, spec = tree_flatten(batch)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def step(*tensors: torch.Tensor) -> torch.Tensor:
        filled = list(leaves)
        for position, tensor in zip(positions, tensors[len(names) :], strict=True):
            filled[position] = tensor
        with reparametrized(module, dict(zip(names, tensors[: len(names)], strict=True))):
            return loss_fn(module, tree_unflatten(filled, spec))

    graphs: list[Any] = []

    def partition(joint: Any, inputs: Any, **options: Any) -> tuple[Any, Any]:
        with activation_memory_budget(budget):
            graphs[:] = min_cut_partition(joint, inputs, **options)
        return graphs[0], graphs[1]

    traced = trace_forward_and_backward(step, partition, len(names), compile_decompositions())
    autocast = torch.autocast("cpu", dtype=half, enabled=half is not None, cache_enabled=False)
    with fake_mode, autocast:
        batch_tensors = [leaves[i] if is_fake(leaves[i]) else fake_mode.from_tensor(leaves[i]) for i in positions]
        traced(*(state[name] for name in names), *batch_tensors).backward()
    forward, backward = graphs
    handed = {node.name for node in backward.graph.nodes if node.op == "placeholder"}
    step_memory = {  # weights and the batch, and views of them the backward takes (a transposed weight)
        storage for node in forward.graph.nodes if node.op == "placeholder" for storage in _storages(node)
    }
    saved = [node for node in _output_nodes(forward) if node.name in handed and not set(_storages(node)) <= step_memory]
    forward_peak, after_forward = _graph_peak(forward, set())
    backward_peak, _ = _graph_peak(backward, {node.name for node in saved})
    saved_bytes = _total(saved)
    return CompiledStepPeak(
        budget=budget,
        saved_bytes=saved_bytes,
        after_forward=after_forward,
        forward_peak=forward_peak,
        backward_peak=after_forward - saved_bytes + backward_peak,
        gradient_bytes=_total(_output_nodes(backward)),
    )


def _output_nodes(graph_module: Any) -> list[Any]:
    output = next(node for node in graph_module.graph.nodes if node.op == "output")
    return [node for node in tree_flatten(output.args[0])[0] if node is not None]


def _storages(node: Any) -> dict[int, int]:
    """The storages a node's value lives in (an id for each) and their sizes: a view shares its base's."""
    values = [value for value in tree_flatten(node.meta.get("val"))[0] if isinstance(value, torch.Tensor)]
    return {storage_key(value): value.untyped_storage().nbytes() for value in values}


def _total(nodes: list[Any]) -> int:
    storages: dict[int, int] = {}
    for node in nodes:
        storages |= _storages(node)
    return sum(storages.values())


def _graph_peak(graph_module: Any, live_inputs: set[str]) -> tuple[int, int]:
    """(the largest total of the graph's storages, the total at its end), each storage counted from the node that
    makes it to the last use of any node in it; the graph's outputs stay. Placeholders are the step's memory
    (weights, the batch: not counted), but for those named in ``live_inputs`` (the backward's saved tensors:
    counted from the start, freed after their last use)."""
    nodes = list(graph_module.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    ends: dict[int, float] = {}  # storage -> the index after which it is free
    sizes: dict[int, int] = {}
    outputs = set(_output_nodes(graph_module))
    for index, node in enumerate(nodes):
        uses = [position[user] for user in node.users] if node.users else [index]
        end = float("inf") if node in outputs else max(uses)
        for storage, size in _storages(node).items():
            sizes[storage] = size
            ends[storage] = max(ends.get(storage, -1), end)
    placeholders = {storage for node in nodes if node.op == "placeholder" for storage in _storages(node)}
    baseline = {
        storage
        for node in nodes
        if node.op == "placeholder" and node.name not in live_inputs
        for storage in _storages(node)
    }
    counted = set(sizes) - baseline
    live = sum(sizes[storage] for storage in counted & placeholders)
    peak, allocated = live, set(placeholders)
    for index, node in enumerate(nodes):
        for storage in _storages(node):
            if storage not in allocated:
                allocated.add(storage)
                live += sizes[storage]
        peak = max(peak, live)
        for storage in [storage for storage in allocated if ends[storage] == index and storage in counted]:
            live -= sizes[storage]
            counted.discard(storage)
    return peak, live
