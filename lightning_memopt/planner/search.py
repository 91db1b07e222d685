"""plan(): profile the step without a GPU and pick the fastest configuration that fits the device.

The search runs over groups of (precision, attention kernel, micro-batch size), cheapest first by
a lower bound on their step time; a group that cannot beat the best plan found is not profiled.
In a group, one fake-mode profile without checkpointing (the anchor) gives every checkpointing
candidate's estimate (:mod:`~lightning_memopt.planner.estimate`); the cheapest estimates that
could fit are then profiled with their checkpointing applied, until one fits
(:mod:`~lightning_memopt.planner.groups`). Each of them is also a candidate sharded with FSDP over
each shard degree considered and with CPU offload, one rank's memory and traffic predicted from the
unsharded step (:mod:`~lightning_memopt.planner.sharding`). This module checks the arguments
(``_checked_arguments``) and lays out the search (``_search_space``, :mod:`~lightning_memopt.planner.space`,
:mod:`~lightning_memopt.planner.context`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.arguments import check_bool, check_int, check_optional_bool
from lightning_memopt.batch_slicing import batch_size
from lightning_memopt.checkpointing import Policy, check_blocks
from lightning_memopt.memory.profile import LossFn, OptimizerSource
from lightning_memopt.models.structure import model_structure
from lightning_memopt.planner.checkpoint_budget import lean_blocks
from lightning_memopt.planner.context import ROUND_TO, ProfileProgress, SearchContext
from lightning_memopt.planner.groups import measure_chosen_options, search_groups
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.report import Plan, PlanError, ResultChangingOption
from lightning_memopt.planner.sharding import ShardedModel, Sharding
from lightning_memopt.planner.space import (
    DEFAULT_SAFETY_MARGIN,
    Group,
    check_choice_in,
    check_safety_margin,
    check_sequence,
    layouts_for,
    micro_batch_sizes,
)
from lightning_memopt.selection import describe_model
from lightning_memopt.strategies.sharding import ShardingError
from lightning_memopt.vocabulary import ATTENTION_IMPLS, PRECISIONS


def plan(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    devices: int = 1,
    shards: Sequence[int] | None = None,
    cpu_offload: Sequence[bool] = (False, True),
    gather_as_stored: bool = False,
    precisions: Sequence[str] | None = None,
    attn_impls: Sequence[str | None] | None = None,
    micro_batching: bool | None = None,
    blocks: Any = "auto",
    options: Sequence[ResultChangingOption] = (),
    progress: bool = False,
    verify: int = 3,
    every_kind: bool = False,
) -> Plan:
    """Pick the fastest configuration whose predicted peak fits ``hardware``'s memory less the safety margin.

    Args:
        model: a module (a LightningModule supplies its own step and optimizer) or a factory
            building one; profiled on fake tensors, never run.
        batch: one training batch at the size to be trained.
        hardware: the device (:func:`~lightning_memopt.planner.gpu`, :func:`~lightning_memopt.planner.with_budget`).
        loss_fn / optimizer: for a plain module, as in :func:`~lightning_memopt.memory.profile_step`.
        safety_margin: the fraction of memory kept free (CUDA context, fragmentation, kernels' workspaces).
        devices: the GPUs there are; sharding with FSDP (``fsdp_memopt``) over up to this many is a
            candidate too.
        shards: the FSDP shard degrees to consider (each a number of GPUs, at most ``devices``);
            default 1 (no sharding), every power of two below ``devices``, and ``devices``.
        cpu_offload: whether to consider keeping parameters, gradients and optimizer state in host
            memory (``fsdp_memopt`` with ``cpu_offload``), at every shard degree: ``(False, True)``
            both, ``(False,)`` never.
        gather_as_stored: plan ``fsdp_memopt`` gathering the units as stored (fp32), as under ``MemoryBudget``'s
            PrecisionSwitch; default: in the half precision, as when the Trainer runs a mixed precision.
        precisions: the precisions to consider; default the device's mixed precision and ``32-true``.
        attn_impls: attention kernels to consider; default ``sdpa`` when the model has attention,
            and ``math`` too on a device where fused attention may be slower (the CPU).
        micro_batching: consider micro-batches with accumulation; default unless the model's
            ``batch_coupled_loss`` is true. A micro-batch the model refuses is left out, with its reason.
        blocks: the modules checkpointing acts on: ``"auto"`` (declared, else discovered), or module classes,
            dotted paths and name globs for the rare model where discovery picks the wrong ones.
        options: result-changing options to measure against the chosen plan.
        progress: show the profiles' progress (a bar on a terminal, one line at the end in a log file).
        verify: the most candidates per group profiled to confirm an estimate; when none of them
            fits, as many more (at least one) of those estimated to fit are confirmed.
        every_kind: search every kind of step (precision, attention kernel, micro-batches or not) even where its
            least price cannot beat the choice: what trials on the device (:mod:`~lightning_memopt.planner.trials`)
            need.

    Raises:
        PlanError: the model state alone passes the budget in the most saving layout considered (the message
            breaks it down); ``blocks`` that match no module; only sharded layouts for a model that cannot shard.
        ValueError: a bad argument.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> from lightning_memopt.planner import with_budget, gpu
        >>> result = plan(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48),
        ...               with_budget(gpu("a100_80gb"), 0.04), loss_fn=lambda m, x: m(x).square().mean(),
        ...               optimizer=lambda p: torch.optim.AdamW(p))
        >>> result.chosen.fits, result.chosen.knobs.checkpoint   # 40 MiB (cuBLAS's 16 among them) hold the step
        (True, 'none')
    """
    checked = _checked_arguments(
        model,
        hardware,
        loss_fn,
        optimizer,
        safety_margin=safety_margin,
        devices=devices,
        shards=shards,
        cpu_offload=cpu_offload,
        gather_as_stored=gather_as_stored,
        precisions=precisions,
        attn_impls=attn_impls,
        micro_batching=micro_batching,
        blocks=blocks,
        options=options,
        progress=progress,
        verify=verify,
        every_kind=every_kind,
    )
    space = _search_space(model, hardware, blocks, checked)
    limit = int(hardware.memory_bytes * (1 - checked.safety_margin))
    progress_bar = ProfileProgress() if checked.progress else None
    search = SearchContext(
        space.factory,
        batch,
        loss_fn,
        optimizer,
        hardware,
        limit,
        space.layouts,
        space.sharded_model,
        checked.gather_as_stored,
        blocks,
        [name for name, _ in space.found],
        lean_blocks(space.found),
        space.trainable,
        progress_bar,
    )
    groups = [
        Group(precision, attn, size)
        for precision in space.precisions
        for attn in space.attn_impls
        for size in (micro_batch_sizes(batch_size(batch)) if space.micro_batching else [None])
    ]
    try:
        best = search_groups(search, groups, checked.verify, options, checked.every_kind)
        measured = measure_chosen_options(search, best, groups[0], options)
    finally:
        if progress_bar is not None:
            progress_bar.close()
    return Plan(
        hardware=hardware,
        limit_bytes=limit,
        safety_margin=checked.safety_margin,
        candidates=search.candidates,
        skipped=search.skipped,
        rejected=search.rejected,
        chosen=best,
        options=measured,
        profiles=search.profiles,
        notes=space.notes,
    )


@dataclass(frozen=True)
class _Checked:
    """plan()'s arguments, checked; ``None`` where the model or the hardware decides."""

    safety_margin: float
    devices: int
    shards: Sequence[int] | None
    verify: int
    gather_as_stored: bool
    micro_batching: bool | None
    progress: bool
    every_kind: bool
    precisions: list[str] | None
    attn_impls: list[str | None] | None
    layouts: list[Sharding]


def _checked_arguments(
    model: Any,
    hardware: Any,
    loss_fn: Any,
    optimizer: Any,
    *,
    safety_margin: Any,
    devices: Any,
    shards: Any,
    cpu_offload: Any,
    gather_as_stored: Any,
    precisions: Any,
    attn_impls: Any,
    micro_batching: Any,
    blocks: Any,
    options: Any,
    progress: Any,
    verify: Any,
    every_kind: Any,
) -> _Checked:
    """plan()'s arguments checked in order: the ``TypeError`` or ``ValueError`` of the first bad one."""
    safety_margin = check_safety_margin(safety_margin)
    devices = check_int("devices", devices, minimum=1)
    verify = check_int("verify", verify, minimum=0)
    gather_as_stored = check_bool("gather_as_stored", gather_as_stored)
    micro_batching = check_optional_bool("micro_batching", micro_batching)
    progress = check_bool("progress", progress)
    every_kind = check_bool("every_kind", every_kind)
    if not isinstance(hardware, Hardware):
        raise TypeError(
            f"`hardware` must be a Hardware (gpu(name), with_budget(...), cuda_hardware(device), measure_cpu(bytes)), "
            f"got {hardware!r} ({type(hardware).__name__})"
        )
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(f"`model` must be an nn.Module or a function building one, got {type(model).__name__}")
    for name, function in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if function is not None and not callable(function):
            raise TypeError(f"`{name}` must be a function or None, got {function!r} ({type(function).__name__})")
    if precisions is not None:
        precisions = [
            check_choice_in("precisions", item, PRECISIONS) for item in check_sequence("precisions", precisions)
        ]
    if attn_impls is not None:
        choices = (*ATTENTION_IMPLS, None)
        attn_impls = [
            check_choice_in("attn_impls", entry, choices) for entry in check_sequence("attn_impls", attn_impls)
        ]
    for option in check_sequence("options", options, empty=True):
        if not isinstance(option, ResultChangingOption):
            raise TypeError(f"`options` entry {option!r} must be a ResultChangingOption")
    layouts = layouts_for(devices, shards, cpu_offload)
    check_blocks(blocks)
    return _Checked(
        safety_margin,
        devices,
        shards,
        verify,
        gather_as_stored,
        micro_batching,
        progress,
        every_kind,
        precisions,
        attn_impls,
        layouts,
    )


@dataclass(frozen=True)
class _Space:
    """What the search tries, from the model (built on the meta device) and the hardware; notes say what not."""

    factory: Callable[[], nn.Module]
    found: list[tuple[str, nn.Module]]
    trainable: int
    layouts: list[Sharding]
    sharded_model: ShardedModel | None
    precisions: list[str]
    attn_impls: list[str | None]
    micro_batching: bool
    notes: list[str]


def _search_space(model: Any, hardware: Hardware, blocks: Any, checked: _Checked) -> _Space:
    """The layouts, precisions, attention kernels and micro-batching to search, with a note on each left out.

    Raises ``PlanError`` when ``blocks`` match no module, or when only sharded layouts are asked of a model
    ``fsdp_memopt`` cannot shard."""
    factory = (lambda: model) if isinstance(model, nn.Module) else model
    with torch.device("meta"):
        described = factory() if not isinstance(model, nn.Module) else model
    structure = model_structure(described)
    found = Policy(blocks).matches(described)
    if not found and Policy(blocks).modules is not None:
        raise PlanError(f"`blocks`={blocks!r} match no module of the model; {describe_model(described)}")
    trainable = sum(p.numel() * 4 for p in described.parameters() if p.requires_grad)
    has_attention = bool(structure.attention)
    coupled = bool(getattr(described, "batch_coupled_loss", False))
    precisions = checked.precisions if checked.precisions is not None else [hardware.mixed_precision, "32-true"]
    notes = [_blocks_note(blocks, structure, found)]
    layouts = checked.layouts
    if hardware.host_is_device:
        # the host is the device: a copy to it frees nothing (block offload is left out in block_options too)
        layouts = layouts_for(checked.devices, checked.shards, (False,))
        notes.append(
            f"offload not considered: on {hardware.name} the host is the device, so a copy to it frees nothing"
        )
    attn_impls = checked.attn_impls
    if attn_impls is not None:
        attn_impls = list(attn_impls)
    elif not has_attention:
        attn_impls = [None]
    elif hardware.fused_attention_wins:
        attn_impls = ["sdpa"]
        notes.append(
            f"math attention not considered: on {hardware.name} fused attention (sdpa) needs no more memory "
            "and no more time with any other knobs"
        )
    else:
        attn_impls = ["sdpa", "math"]
    use_micro = (not coupled) if checked.micro_batching is None else checked.micro_batching
    if not use_micro:
        notes.append("micro-batching not considered: the loss couples the samples of a batch")
    sharded_model = None
    if any(layout.active for layout in layouts):
        try:
            sharded_model = ShardedModel.of(described, blocks, round_to=ROUND_TO)
        except ShardingError as error:
            layouts = [layout for layout in layouts if not layout.active]
            if not layouts:
                raise PlanError(f"fsdp_memopt cannot shard the model: {error}") from None
            notes.append(f"FSDP sharding and CPU offload not considered: {error}")
    return _Space(factory, found, trainable, layouts, sharded_model, list(precisions), attn_impls, use_micro, notes)


def _blocks_note(blocks: Any, structure: Any, found: list[tuple[str, nn.Module]]) -> str:
    if Policy(blocks).modules is not None:
        return f"checkpointing acts on the {len(found)} modules `blocks` selects"
    if not found:
        return (
            "checkpointing not considered: the model declares no blocks and no repeated blocks were discovered; "
            "pass `blocks` (module classes, dotted paths or name globs)"
        )
    return f"checkpointing acts on {structure.describe_blocks()}"
