"""The split of a block's traced joint graph for full or selective recomputation, and its batch norms.

:func:`recompute_partition` tags each forward node of the joint graph (AOTAutograd's trace of a block's forward and
backward): for selective, the outputs of :data:`~lightning_memopt.checkpointing.selective.SAVED_OPS`, of random ops
and of training batch norms are saved, every other op is recomputed in backward; for full, only the training batch
norms' (their new running statistics) are. PyTorch's min-cut partitioner honours the tags.
Batch norm in training needs two changes to the graph:

- its recomputation must not read the running statistics (the forward has changed them since: autograd would
  refuse the saved tensor): beside each one goes a batch norm by the batch's statistics alone, which every op
  takes its outputs from, and which backward recomputes;
- the forward runs it as the plain step does: one kernel that updates the statistics in place (the graph hands them
  back as their new values, and copying a tensor onto itself launches nothing), the twin's outputs taken from it.

Example::

    >>> import torch.fx
    >>> graph = torch.fx.symbolic_trace(lambda primals_1, tangents_1: (primals_1.sin(), tangents_1 * 2)).graph
    >>> sorted(node.name for node in backward_nodes(graph))
    ['mul', 'output', 'tangents_1']
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from lightning_memopt.checkpointing.selective import SAVED_OPS
from lightning_memopt.private_api import BATCH_NORM_OPS, is_aten_op, min_cut_partition, not_random

_BATCH_NORM = BATCH_NORM_OPS.training  # returns the new running statistics
_BATCH_NORM_BATCH_STATISTICS = BATCH_NORM_OPS.batch_statistics  # reads none
_BATCH_NORM_IN_PLACE = BATCH_NORM_OPS.in_place  # updates them in place
_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default
_ADD, _ADD_IN_PLACE = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor


class DrawsRandomNumbers(Exception):
    """A block traced for full recomputation draws random numbers: its recomputation would save what it drew."""


def recompute_partition(
    joint: Any, inputs: Any, counters: set[str], mode: str = "selective", **options: Any
) -> tuple[Any, Any]:
    """Split the joint graph for ``mode``: ``"selective"`` saves the outputs of expensive and random ops and recomputes
    every other forward op in backward; ``"full"`` saves nothing but the block's inputs and recomputes, in backward,
    the forward ops backward needs (not those after them). Batch norm is recomputed from its batch's statistics, its
    forward run once.

    Raises:
        DrawsRandomNumbers: ``mode="full"`` and an op draws random numbers (attention given ``dropout_p=0`` draws
            none).
    """
    _recompute_batch_norm_from_batch(joint.graph)
    backward = backward_nodes(joint.graph)
    drawless: set[Any] = set()  # ops tagged random that this graph calls without drawing
    for node in joint.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        source = node.args[0] if node.target is operator.getitem else node
        if mode == "full":
            if _random(source) and not _without_dropout(source, joint):
                raise DrawsRandomNumbers(f"{source.target} draws random numbers")
            drawless.update([source.target] if _random(source) else [])
            saved = source.target is _BATCH_NORM
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.MUST_RECOMPUTE
        else:
            saved = source.target in SAVED_OPS or source.target is _BATCH_NORM or _random(source)
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = 1
    joint.recompile()
    with not_random(drawless):  # else the partition would save and restore the generator around them
        forward, backward = min_cut_partition(joint, inputs, **options)
    _batch_norm_in_place_in_forward(forward.graph, counters)
    forward.recompile()
    return forward, backward


def _without_dropout(node: Any, joint: Any) -> bool:
    """Whether ``node`` calls an op whose only randomness is its dropout, with ``dropout_p=0`` (attention's)."""
    arguments = node.normalized_arguments(joint, normalize_to_only_use_kwargs=True)
    return arguments is not None and arguments.kwargs.get("dropout_p", None) == 0


def _recompute_batch_norm_from_batch(graph: Any) -> None:
    """Beside each training batch norm, one by the batch's statistics alone, whose outputs every op takes; the first
    keeps only the running statistics it returns, and backward reads none of them (training mode ignores them)."""
    for node in list(graph.nodes):
        if node.target is not _BATCH_NORM or not node.args[5]:
            continue
        x, weight, bias, _, _, training, momentum, eps = node.args
        with graph.inserting_after(node):
            batch = graph.call_function(_BATCH_NORM_BATCH_STATISTICS, (x, weight, bias, training, momentum, eps))
        for user in list(node.users):
            index = user.args[1]
            if index < 3:
                with graph.inserting_after(batch):
                    user.replace_all_uses_with(graph.call_function(operator.getitem, (batch, index)))
                graph.erase_node(user)
            else:
                for reader in list(user.users):
                    if reader.target is _BATCH_NORM_BACKWARD:
                        reader.update_arg(index, None)  # running_mean (3) / running_var (4): unread in training
    graph.lint()


def _batch_norm_in_place_in_forward(graph: Any, counters: set[str]) -> None:
    """The forward graph's training batch norms as the unchecked forward runs them: one kernel that updates the
    running statistics in place (they are what the graph returns for them, so copying them back copies nothing),
    its outputs taken also for the batch-statistics twin beside it; the ``counters`` (placeholders of batch norms'
    ``num_batches_tracked``) incremented in place."""
    twins = {node.args[:3]: node for node in graph.nodes if node.target is _BATCH_NORM_BATCH_STATISTICS}
    for node in list(graph.nodes):
        if node.target is _BATCH_NORM and node.args[5] and all(a.op == "placeholder" for a in node.args[3:5]):
            with graph.inserting_before(node):
                in_place = graph.call_function(_BATCH_NORM_IN_PLACE, node.args)
            twin = twins.pop(node.args[:3], None)
            for source in (node, twin) if twin is not None else (node,):
                for user in list(source.users):
                    index = user.args[1]
                    if index < 3:
                        with graph.inserting_after(in_place):
                            replacement = graph.call_function(operator.getitem, (in_place, index))
                    else:
                        replacement = node.args[index]  # the running statistic, updated in place
                    user.replace_all_uses_with(replacement)
                    graph.erase_node(user)
                graph.erase_node(source)
        elif node.target is _ADD and node.args[0].op == "placeholder" and node.args[0].name in counters:
            with graph.inserting_before(node):
                node.replace_all_uses_with(graph.call_function(_ADD_IN_PLACE, node.args, node.kwargs))
            graph.erase_node(node)
    graph.lint()


def backward_nodes(graph: Any) -> set[Any]:
    """The nodes that depend on a tangent (an output's gradient): the backward half of a joint graph."""
    backward: set[Any] = set()
    for node in graph.nodes:
        tangent = node.op == "placeholder" and node.name.startswith("tangents")
        if tangent or any(parent in backward for parent in node.all_input_nodes):
            backward.add(node)
    return backward


def _random(node: Any) -> bool:
    return is_aten_op(node.target) and torch.Tag.nondeterministic_seeded in node.target.tags
