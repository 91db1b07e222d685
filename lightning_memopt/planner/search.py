"""plan(): profile the step without a GPU and pick the fastest configuration that fits the device.

The search runs over groups of (precision, attention kernel, micro-batch size), cheapest first by
a lower bound on their step time; a group that cannot beat the best plan found is not profiled.
In a group, one fake-mode profile without checkpointing (the anchor) gives every checkpointing
candidate's estimate (:mod:`~lightning_memopt.planner.estimate`); the cheapest estimates that
could fit are then profiled with their checkpointing applied, until one fits. Each of them is also
a candidate sharded with FSDP over each shard degree considered and with CPU offload, one rank's
memory and traffic predicted from the unsharded step (:mod:`~lightning_memopt.planner.sharding`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_memopt.accumulation.split import batch_size, slice_batch
from lightning_memopt.arguments import check_bool, check_fraction, check_int, check_optional_bool
from lightning_memopt.checkpointing import Policy, apply_activation_checkpointing, check_blocks
from lightning_memopt.memory.profile import LossFn, MemoryProfile, OptimizerSource, profile_step
from lightning_memopt.memory.tracker import CATEGORIES
from lightning_memopt.memory.work import Work
from lightning_memopt.models.structure import model_structure, set_attention
from lightning_memopt.planner.cost import StepCost, step_cost
from lightning_memopt.planner.estimate import MOMENTS, StepEstimate, checkpointed, from_profile
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.options import MeasuredOption, ResultChangingOption, measure_options
from lightning_memopt.planner.report import Plan
from lightning_memopt.planner.sharding import (
    UNSHARDED,
    ShardedModel,
    ShardedTraffic,
    Sharding,
    sharded_estimate,
    sharded_traffic,
)
from lightning_memopt.selection import describe_model
from lightning_memopt.strategies.sharding import ShardingError
from lightning_memopt.vocabulary import ATTENTION_IMPLS, PRECISIONS, format_bytes

_ROUND_TO = 512  # the profiles count each tensor in 512-byte blocks, as the CUDA caching allocator
# estimates run up to 15 % over their profiles (offload, mixed precision): those within 20 % of the limit are profiled
CONFIRM_WINDOW = 1.2
# checkpointing from cheapest to most saving: (mode, every_n)
CHECKPOINT_LADDER = (
    ("none", 1),
    ("selective", 1),
    ("full", 4),
    ("full", 3),
    ("full", 2),
    ("full", 1),
    ("offload", 2),
    ("offload", 1),
)


class PlanError(ValueError):
    """No plan can be made: the budget cannot hold even the model states, or ``blocks`` select nothing."""


@dataclass
class Candidate:
    """One configuration: its knobs, predicted memory and work, estimated step time, and how it was predicted."""

    knobs: Knobs
    estimate: StepEstimate
    cost: StepCost
    fits: bool
    # "profiled", "estimated" (from the group's anchor) or "sharded" (FSDP / CPU offload, from a profiled step)
    how: str
    estimated_bytes: int | None = None  # for a profiled candidate first estimated: that estimate

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        return self.estimate.breakdown

    @property
    def host_bytes(self) -> int:
        return self.estimate.host_bytes


@dataclass
class _Group:
    precision: str
    attn_impl: str | None
    micro_batch_size: int | None
    lower_bound: float = 0.0


@dataclass
class _Search:
    model: Callable[[], nn.Module]
    batch: Any
    loss_fn: LossFn | None
    optimizer: OptimizerSource | None
    hardware: Hardware
    limit: int
    layouts: list[Sharding]  # the FSDP shard degrees and CPU offload considered, unsharded first
    sharded_model: ShardedModel | None  # its FSDP units (None: no sharding considered)
    gather_as_stored: bool  # fsdp_memopt gathers units as stored under mixed precision (PrecisionSwitch's)
    block_spec: Any  # the policy's modules: "auto" or the classes, paths and globs given as `blocks`
    blocks: list[str]
    selections: dict[int, list[str]]  # every_n -> the blocks it checkpoints
    trainable_bytes: int
    progress: Any
    profiles: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[Knobs, float]] = field(default_factory=list)
    rejected: list[tuple[Knobs, str]] = field(default_factory=list)
    smallest_rejected: tuple[int, str] | None = None  # the largest micro-batch the model refused, and why

    def profile(self, knobs: Knobs, model: Callable[[], nn.Module] | None = None, batch: Any = None) -> MemoryProfile:
        """A fake-mode profile of one step with ``knobs`` applied (of another model or batch, if given)."""
        batch = self.batch if batch is None else batch
        if knobs.micro_batch_size is not None:
            batch = slice_batch(batch, 0, knobs.micro_batch_size)

        def prepare(model: nn.Module) -> None:
            set_attention(model, knobs.attn_impl)
            policy = knobs.checkpoint_policy(self.block_spec)
            if policy is not None:
                apply_activation_checkpointing(model, policy)

        if self.progress is not None:
            self.progress.set_postfix_str(knobs.describe())
        result = profile_step(
            self.model if model is None else model,
            batch,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            mode="fake",
            precision=knobs.precision,
            steps=1,
            warm_optimizer=True,
            prepare_model=prepare,
            round_to=_ROUND_TO,
            blocks=tuple(self.blocks) if knobs.checkpoint == "none" and model is None else (),
        )
        self.profiles += 1
        if self.progress is not None:
            self.progress.update(1)
        return result

    def micro_batches(self, knobs: Knobs) -> int:
        size = batch_size(self.batch)
        return 1 if knobs.micro_batch_size is None else math.ceil(size / knobs.micro_batch_size)

    def accumulation_bytes(self, knobs: Knobs) -> int:
        # micro-batches after the first run their backward with the accumulated gradients alive
        return self.trainable_bytes if knobs.micro_batch_size is not None else 0

    def candidate(self, knobs: Knobs, estimate: StepEstimate, how: str) -> Candidate:
        """``knobs`` with ``estimate`` of the step unsharded: sharded as the knobs say, priced, listed."""
        traffic = self.traffic(knobs)
        if knobs.sharding.active:
            estimate = self.sharded(knobs, estimate)
            how = "sharded" if how == "profiled" else how
        cost = step_cost(
            estimate.step_work,
            estimate.optimizer_work,
            self.hardware,
            micro_batches=self.micro_batches(knobs),
            offloaded_bytes=estimate.offloaded_bytes,
            traffic=traffic,
            checkpoint_mode=knobs.checkpoint,
            regions=estimate.regions,
            region_kernels=estimate.region_kernels,
        )
        found = Candidate(knobs, estimate, cost, estimate.peak_bytes <= self.limit, how)
        self.candidates.append(found)
        return found

    def sharded(self, knobs: Knobs, estimate: StepEstimate) -> StepEstimate:
        """One rank's ``estimate`` (of the step unsharded) under ``knobs``' sharding."""
        if self.sharded_model is None:
            return estimate
        return sharded_estimate(estimate, self.sharded_model, self._sharding(knobs), knobs.precision)

    def traffic(self, knobs: Knobs) -> ShardedTraffic:
        """What ``knobs``' sharding moves per micro-batch, and the share of the optimizer step left on the device."""
        if self.sharded_model is None:
            return UNSHARDED
        return sharded_traffic(self.sharded_model, self._sharding(knobs), knobs.precision)

    def _sharding(self, knobs: Knobs) -> Sharding:
        return replace(knobs.sharding, gather_as_stored=self.gather_as_stored)

    def candidates_of(self, knobs: Knobs, estimate: StepEstimate, how: str) -> list[Candidate]:
        """``knobs`` (unsharded) in every layout considered."""
        return [
            self.candidate(replace(knobs, shards=layout.shards, cpu_offload=layout.cpu_offload), estimate, how)
            for layout in self.layouts
        ]


def plan(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    safety_margin: float = 0.1,
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
        gather_as_stored: under a mixed precision ``fsdp_memopt`` gathers the units as stored
            (fp32; autocast casts the weights): what it does when PrecisionSwitch applies the
            precision (``MemoryBudget``). Default: in the half precision, as when the Trainer runs it.
        precisions: the precisions to consider; default the device's mixed precision and ``32-true``.
        attn_impls: attention kernels to consider; default ``sdpa`` when the model has attention,
            and ``math`` too on a device where fused attention may be slower (the CPU).
        micro_batching: consider micro-batches with accumulation; default unless the model's
            ``batch_coupled_loss`` is true (then micro-batching would change the loss). A
            micro-batch the model refuses (a profile of it raises, e.g. batch norm on one sample)
            is left out with the reason in the table, and so are the smaller ones.
        blocks: the modules checkpointing acts on: ``"auto"`` (those the model declares, else its
            repeated blocks, discovered), or module classes, dotted paths and name globs for the
            rare model where discovery picks the wrong ones.
        options: result-changing options to measure against the chosen plan.
        progress: show a progress bar of the profiles.
        verify: the most candidates per group profiled to confirm an estimate; when none of them
            fits, as many more (at least one) of those estimated to fit are confirmed.

    Raises:
        PlanError: the budget is smaller than what parameters, gradients and optimizer state need on
            the device in the most saving layout considered (sharded ``max(shards)`` ways, or with
            CPU offload the units in flight); the message shows that breakdown, what sharding and
            offload would need, and the result-changing options; ``blocks`` that match no module;
            only sharded layouts asked of a model ``fsdp_memopt`` cannot shard.
        ValueError: a bad argument.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> from lightning_memopt.planner import with_budget, gpu
        >>> result = plan(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48),
        ...               with_budget(gpu("a100_80gb"), 0.01), loss_fn=lambda m, x: m(x).square().mean(),
        ...               optimizer=lambda p: torch.optim.AdamW(p))
        >>> result.chosen.fits, result.chosen.knobs.checkpoint   # 10 MiB hold the step without checkpointing
        (True, 'none')
    """
    safety_margin = check_safety_margin(safety_margin)
    devices = check_int("devices", devices, minimum=1)
    verify = check_int("verify", verify, minimum=0)
    gather_as_stored = check_bool("gather_as_stored", gather_as_stored)
    micro_batching = check_optional_bool("micro_batching", micro_batching)
    progress = check_bool("progress", progress)
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
        precisions = [_check_choice_in("precisions", item, PRECISIONS) for item in _sequence("precisions", precisions)]
    if attn_impls is not None:
        choices = (*ATTENTION_IMPLS, None)
        attn_impls = [_check_choice_in("attn_impls", entry, choices) for entry in _sequence("attn_impls", attn_impls)]
    for option in _sequence("options", options, empty=True):
        if not isinstance(option, ResultChangingOption):
            raise TypeError(f"`options` entry {option!r} must be a ResultChangingOption")
    layouts = _layouts(devices, shards, cpu_offload)
    check_blocks(blocks)
    factory = (lambda: model) if isinstance(model, nn.Module) else model
    with torch.device("meta"):
        described = factory() if not isinstance(model, nn.Module) else model
    structure = model_structure(described)
    found = Policy(blocks).matches(described)
    if not found and Policy(blocks).modules is not None:
        raise PlanError(f"`blocks`={blocks!r} match no module of the model; {describe_model(described)}")
    selections = {
        n: [name for name, _ in Policy(blocks, every_n=n).matches(described)] for n in {n for _, n in CHECKPOINT_LADDER}
    }
    trainable = sum(p.numel() * 4 for p in described.parameters() if p.requires_grad)
    has_attention = bool(structure.attention)
    coupled = bool(getattr(described, "batch_coupled_loss", False))
    precisions = list(precisions) if precisions is not None else [hardware.mixed_precision, "32-true"]
    notes = [_blocks_note(blocks, structure, found)]
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
    use_micro = (not coupled) if micro_batching is None else micro_batching
    if not use_micro:
        notes.append("micro-batching not considered: the loss couples the samples of a batch")
    sharded_model = None
    if any(layout.active for layout in layouts):
        try:
            sharded_model = ShardedModel.of(described, blocks, round_to=_ROUND_TO)
        except ShardingError as error:
            layouts = [layout for layout in layouts if not layout.active]
            if not layouts:
                raise PlanError(f"fsdp_memopt cannot shard the model: {error}") from None
            notes.append(f"FSDP sharding and CPU offload not considered: {error}")
    limit = int(hardware.memory_bytes * (1 - safety_margin))
    progress_bar = _progress_bar() if progress else None
    search = _Search(
        factory,
        batch,
        loss_fn,
        optimizer,
        hardware,
        limit,
        layouts,
        sharded_model,
        gather_as_stored,
        blocks,
        [name for name, _ in found],
        selections,
        trainable,
        progress_bar,
    )
    groups = [
        _Group(precision, attn, size)
        for precision in precisions
        for attn in attn_impls
        for size in (_micro_batch_sizes(batch_size(batch)) if use_micro else [None])
    ]
    try:
        best = _run(search, groups, verify, options)
        measured = _measure_options(search, best, groups[0], options)
    finally:
        if progress_bar is not None:
            progress_bar.close()
    return Plan(
        hardware=hardware,
        limit_bytes=limit,
        safety_margin=safety_margin,
        candidates=search.candidates,
        skipped=search.skipped,
        rejected=search.rejected,
        chosen=best,
        options=measured,
        profiles=search.profiles,
        notes=notes,
    )


def _run(
    search: _Search, groups: list[_Group], verify: int, options: Sequence[ResultChangingOption]
) -> Candidate | None:
    best: Candidate | None = None
    reference: MemoryProfile | None = None
    pending = list(groups)
    while pending:
        if reference is not None:
            for group in pending:
                group.lower_bound = _lower_bound(search, reference, group)
            pending.sort(key=lambda group: group.lower_bound)
        group = pending.pop(0)
        knobs = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
        if best is not None and group.lower_bound >= best.cost.total:
            search.skipped.append((knobs, group.lower_bound))
            continue
        anchor = _anchor(search, knobs)
        if anchor is None:
            continue
        if reference is None:
            reference = anchor
            _check_model_states(search, anchor, options)
        found = _search_group(search, group, anchor, verify)
        if found is not None and (best is None or found.cost.total < best.cost.total):
            best = found
    return best


def _anchor(search: _Search, knobs: Knobs) -> MemoryProfile | None:
    """The group's profile without checkpointing; ``None`` when the model refuses its micro-batch size."""
    size = knobs.micro_batch_size
    if size is None:
        return search.profile(knobs)
    if search.smallest_rejected is not None and size <= search.smallest_rejected[0]:
        search.rejected.append((knobs, search.smallest_rejected[1]))
        return None
    try:
        return search.profile(knobs)
    except Exception as error:  # the whole batch profiled: what fails here is the micro-batch's size
        reason = f"the model refuses micro-batches of {size} ({type(error).__name__}: {_first_line(error)})"
        search.smallest_rejected = (size, reason)
        search.rejected.append((knobs, reason))
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _blocks_note(blocks: Any, structure: Any, found: list[tuple[str, nn.Module]]) -> str:
    if Policy(blocks).modules is not None:
        return f"checkpointing acts on the {len(found)} modules `blocks` selects"
    if not found:
        return (
            "checkpointing not considered: the model declares no blocks and no repeated blocks were discovered; "
            "pass `blocks` (module classes, dotted paths or name globs)"
        )
    return f"checkpointing acts on {structure.describe_blocks()}"


def _search_group(search: _Search, group: _Group, anchor: MemoryProfile, verify: int) -> Candidate | None:
    base = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
    extra = search.accumulation_bytes(base)
    confirmed = search.candidates_of(base, from_profile(anchor, extra), "profiled")
    estimates: list[Candidate] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for mode, every_n in CHECKPOINT_LADDER[1:]:
        chosen = search.selections[every_n]
        key = (mode, tuple(chosen))
        if not chosen or key in seen:
            continue
        seen.add(key)
        knobs = replace(base, checkpoint=mode, every_n=every_n)
        estimates += search.candidates_of(knobs, checkpointed(anchor, chosen, mode, extra), "estimated")
    best = _cheapest_fitting(confirmed, None)
    ordered = sorted(estimates, key=lambda c: c.cost.total)
    tries = 0
    for estimate in ordered:
        if best is not None and estimate.cost.total >= best.cost.total:
            break
        confirmed_already = estimate not in search.candidates  # as another layout of the same knobs
        if confirmed_already or tries >= verify or estimate.peak_bytes > search.limit * CONFIRM_WINDOW:
            continue
        tries += 1
        best = _cheapest_fitting(_confirm(search, estimate.knobs, extra, estimates), best)
    # the tries went to estimates just over the limit: confirm the cheapest ones estimated to fit as well
    fitting = [c for c in ordered if c.fits and c in search.candidates]
    for estimate in fitting[: max(verify, 1)]:
        if best is not None:
            break
        if estimate in search.candidates:
            best = _cheapest_fitting(_confirm(search, estimate.knobs, extra, estimates), best)
    return best


def _cheapest_fitting(candidates: list[Candidate], best: Candidate | None) -> Candidate | None:
    for candidate in candidates:
        if candidate.fits and (best is None or candidate.cost.total < best.cost.total):
            best = candidate
    return best


def _confirm(search: _Search, knobs: Knobs, extra: int, estimates: list[Candidate]) -> list[Candidate]:
    """Profile the checkpointing of ``knobs``, in place of its estimates in every layout; the confirmed candidates."""
    unsharded = replace(knobs, shards=1, cpu_offload=False)
    replaced = {c.knobs: c for c in estimates if replace(c.knobs, shards=1, cpu_offload=False) == unsharded}
    for candidate in replaced.values():
        search.candidates.remove(candidate)  # the profile replaces the estimate
    planned = next(iter(replaced.values())).estimate
    profiled_estimate = replace(
        from_profile(search.profile(unsharded), extra), regions=planned.regions, region_kernels=planned.region_kernels
    )
    confirmed = search.candidates_of(unsharded, profiled_estimate, "profiled")
    for candidate in confirmed:
        candidate.estimated_bytes = replaced[candidate.knobs].peak_bytes
    return confirmed


def _measure_options(
    search: _Search, best: Candidate | None, first: _Group, options: Sequence[ResultChangingOption]
) -> list[MeasuredOption]:
    if not options:
        return []
    if best is not None and not best.knobs.sharding.active:
        exact = best.how == "profiled" and best.knobs.micro_batch_size is None
        return measure_options(search.profile, best.knobs, options, best.peak_bytes if exact else None)
    return measure_options(search.profile, Knobs(first.precision, first.attn_impl, checkpoint="full"), options)


def _lower_bound(search: _Search, reference: MemoryProfile, group: _Group) -> float:
    """No group step is faster than the reference's work with every flop at the group's precision, unrecomputed,
    and the smallest share of the optimizer's work any layout leaves on the device."""
    work = reference.work(("forward", "backward"))
    flops = work.flops
    half = group.precision != "32-true"
    size = batch_size(search.batch)
    share = 1.0 if group.micro_batch_size is None else group.micro_batch_size / size
    micro = Work(
        half_flops=flops * share if half else 0.0,
        full_flops=0.0 if half else flops * share,
        bytes_written=work.bytes_written * share * (0.5 if half and reference.precision == "32-true" else 1.0),
        kernels=work.kernels,
    )
    knobs = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
    least = min(search.traffic(replace(knobs, shards=layout.shards)).optimizer_share for layout in search.layouts)
    on_device = 0.0 if any(layout.cpu_offload for layout in search.layouts) else least
    traffic = ShardedTraffic(0.0, 0.0, on_device)
    return step_cost(
        micro, reference.work(("optimizer",)), search.hardware, search.micro_batches(knobs), traffic=traffic
    ).total


def _check_model_states(search: _Search, anchor: MemoryProfile, options: Sequence[ResultChangingOption]) -> None:
    """Refuse a budget that cannot hold what the model states need on the device in any layout considered."""
    states = {
        "parameters": anchor.breakdown["parameters"],
        "gradients": search.trainable_bytes,
        "optimizer_state": anchor.breakdown["optimizer_state"],
    }
    # the states alone, as a step: what sharding or offload leaves of them, with the units in flight
    alone = StepEstimate({m: {**dict.fromkeys(CATEGORIES, 0), **states} for m in MOMENTS}, Work(), Work(), 0.0)
    layouts = [
        Knobs(anchor.precision, shards=layout.shards, cpu_offload=layout.cpu_offload) for layout in search.layouts
    ]
    needs = {knobs.sharding: search.sharded(knobs, alone) for knobs in layouts}
    if min(estimate.peak_bytes for estimate in needs.values()) <= search.limit:
        return
    lines = [f"  {name:<16}{format_bytes(nbytes):>12}" for name, nbytes in states.items()]
    for layout, estimate in needs.items():
        if layout.active:
            host = f" and {format_bytes(estimate.host_bytes)} of host memory" if estimate.host_bytes else ""
            lines.append(f"  {layout.describe() + ':':<28}{format_bytes(estimate.peak_bytes)} per GPU{host}")
    listed = "\n".join(f"  - {option.name}: {option.caveat}" for option in options) or "  (none for this model)"
    raise PlanError(
        f"the budget {format_bytes(search.limit)} ({search.hardware.name}, less the safety margin) is smaller "
        f"than the model states alone ({format_bytes(sum(states.values()))}) need on the device in any layout "
        "considered:\n"
        + "\n".join(lines)
        + "\nno setting that keeps the result can fit; options that change the result:\n"
        + listed
    )


def check_safety_margin(safety_margin: Any) -> float:
    """``safety_margin`` as a float in [0, 1): the fraction of the device's memory a plan keeps free.

    Raises:
        TypeError: not a number (``"abc"``).
        ValueError: outside [0, 1).

    Example::

        >>> check_safety_margin(0.1)
        0.1
    """
    return check_fraction("safety_margin", safety_margin, open_maximum=True)


def _sequence(name: str, values: Any, empty: bool = False) -> list[Any]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not (values or empty):
        kind = "a sequence" if empty else "a non-empty sequence"
        raise ValueError(f"`{name}` must be {kind} (a list or tuple), got {values!r} ({type(values).__name__})")
    return list(values)


def _check_choice_in(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}` entry {value!r} is not one of {list(choices)!r}")
    return value


def _layouts(devices: int, shards: Sequence[int] | None, cpu_offload: Sequence[bool]) -> list[Sharding]:
    """Every (shard degree, offload) considered, unsharded first; validates ``shards`` and ``cpu_offload``."""
    if shards is None:
        shards = sorted({1, devices, *(2**power for power in range(devices.bit_length()) if 2**power < devices)})
    for degree in _sequence("shards", shards):
        if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= devices:
            raise ValueError(f"`shards` entry {degree!r} must be an int from 1 to `devices`={devices}")
    if isinstance(cpu_offload, str | bytes) or not isinstance(cpu_offload, Sequence) or not cpu_offload:
        raise ValueError(
            f"`cpu_offload`={cpu_offload!r} must be a non-empty sequence of True / False: (False, True) considers "
            "both, (False,) never offloads"
        )
    flags = [check_bool("cpu_offload", flag) for flag in cpu_offload]
    layouts = [Sharding(degree, flag) for degree in shards for flag in flags]
    return sorted(set(layouts), key=lambda layout: (layout.active, layout.cpu_offload, layout.shards))


def _micro_batch_sizes(size: int) -> list[int | None]:
    sizes: list[int | None] = [None]
    current = size
    while current > 1:
        current = math.ceil(current / 2)
        sizes.append(current)
    return sizes


def _progress_bar() -> Any:
    from tqdm.auto import tqdm

    return tqdm(desc="memopt-plan: profiling candidates", unit="profile", total=None, leave=False)
