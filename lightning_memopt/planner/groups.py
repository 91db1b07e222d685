"""The search over groups: cheapest group first by a lower bound on its step time, each searched from its anchor.

In a group (a precision, attention kernel and micro-batch size), one fake-mode profile without
checkpointing (the anchor) prices each block's checkpointing options, and the checkpointing
frontier (:mod:`~lightning_memopt.planner.frontier`) gives the fastest per-block choices at
:data:`FRONTIER_POINTS` activation targets, each a candidate estimated from the anchor
(:mod:`~lightning_memopt.planner.estimate`); the cheapest estimates that could fit are then
profiled with their checkpointing applied, until one fits. A group whose lower bound cannot beat
the best plan found is not profiled. The first anchor also tells whether the model states fit the
budget in any layout at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_memopt.batch_slicing import batch_size
from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.tracker import CATEGORIES
from lightning_memopt.memory.work import Work
from lightning_memopt.planner.context import SearchContext
from lightning_memopt.planner.cost import step_cost
from lightning_memopt.planner.estimate import MOMENTS, STEP_MOMENTS, StepEstimate, checkpointed, from_profile
from lightning_memopt.planner.frontier import ActivationPeaks, Frontier, block_options
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.report import Candidate, MeasuredOption, PlanError, ResultChangingOption, measure_options
from lightning_memopt.planner.sharding import ShardedTraffic
from lightning_memopt.planner.space import Group
from lightning_memopt.vocabulary import format_bytes

# estimates run up to 15 % over their profiles (offload, mixed precision): those within 20 % of the limit are profiled
CONFIRM_WINDOW = 1.2
FRONTIER_POINTS = 32  # the activation targets, from none checkpointed to the least, that each give a candidate


def search_groups(
    search: SearchContext,
    groups: list[Group],
    verify: int,
    options: Sequence[ResultChangingOption],
    every_kind: bool = False,
) -> Candidate | None:
    """The fastest candidate that fits over ``groups`` (``None``: none fits), searched cheapest group first.

    A group whose least price cannot beat the best so far is skipped, unless ``every_kind`` and no group of its kind
    (precision, attention kernel, micro-batched or not) has given a candidate that fits yet: measuring on the device
    wants the fastest of each kind, since the price that ranks them may be wrong.

    Raises:
        PlanError: the first anchor shows that the model states fit the budget in no layout considered.
    """
    best: Candidate | None = None
    reference: MemoryProfile | None = None
    pending = list(groups)
    kinds_found: set[tuple[str, str | None, bool]] = set()
    while pending:
        if reference is not None:
            for group in pending:
                group.lower_bound = _lower_bound(search, reference, group)
            pending.sort(key=lambda group: group.lower_bound)
        group = pending.pop(0)
        knobs = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
        kind = (group.precision, group.attn_impl, group.micro_batch_size is not None)
        wanted = every_kind and kind not in kinds_found
        if best is not None and group.lower_bound >= best.cost.total and not wanted:
            search.skipped.append((knobs, group.lower_bound))
            continue
        anchor = _anchor(search, knobs)
        if anchor is None:
            continue
        if reference is None:
            reference = anchor
            check_model_states(search, anchor, options)
        found = _search_group(search, group, anchor, verify)
        if found is not None:
            kinds_found.add(kind)
        if found is not None and (best is None or found.cost.total < best.cost.total):
            best = found
    return best


def _anchor(search: SearchContext, knobs: Knobs) -> MemoryProfile | None:
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


def _search_group(search: SearchContext, group: Group, anchor: MemoryProfile, verify: int) -> Candidate | None:
    base = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
    extra = search.accumulation_bytes(base)
    unchecked = from_profile(anchor, extra)
    confirmed = search.candidates_of(base, unchecked, "profiled")
    options = block_options(anchor, search.blocks, search.hardware, search.micro_batches(base), search.lean)
    # what the step holds where checkpointing changes nothing (setup, the end of backward, the optimizer step)
    floor = max((sum(unchecked.phases[m].values()) for m in unchecked.phases if m not in STEP_MOMENTS), default=0)
    estimates: list[Candidate] = []
    for modes in Frontier(options, ActivationPeaks.of_step(unchecked)).points(FRONTIER_POINTS, floor):
        if not modes:
            continue  # nothing checkpointed: the anchor, profiled already
        knobs = base.with_block_modes(modes, options)
        estimates += search.candidates_of(knobs, checkpointed(anchor, modes, extra, search.lean), "estimated")
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


def _confirm(search: SearchContext, knobs: Knobs, extra: int, estimates: list[Candidate]) -> list[Candidate]:
    """Profile the checkpointing of ``knobs``, in place of its estimates in every layout; the confirmed candidates."""
    unsharded = replace(knobs, shards=1, cpu_offload=False)
    replaced = {c.knobs: c for c in estimates if replace(c.knobs, shards=1, cpu_offload=False) == unsharded}
    for candidate in replaced.values():
        search.candidates.remove(candidate)  # the profile replaces the estimate
    planned = next(iter(replaced.values())).estimate
    profiled = from_profile(search.profile(unsharded), extra)
    profiled_estimate = replace(profiled, regions=planned.regions, copies=planned.copies)
    confirmed = search.candidates_of(unsharded, profiled_estimate, "profiled")
    for candidate in confirmed:
        candidate.estimated_bytes = replaced[candidate.knobs].peak_bytes
    return confirmed


def measure_chosen_options(
    search: SearchContext, best: Candidate | None, first: Group, options: Sequence[ResultChangingOption]
) -> list[MeasuredOption]:
    """``options`` measured with the chosen knobs (unsharded; else the first group's, fully checkpointed)."""
    if not options:
        return []
    if best is not None and not best.knobs.sharding.active:
        exact = best.how == "profiled" and best.knobs.micro_batch_size is None
        return measure_options(search.profile, best.knobs, options, best.peak_bytes if exact else None)
    return measure_options(search.profile, Knobs(first.precision, first.attn_impl, checkpoint="full"), options)


def _lower_bound(search: SearchContext, reference: MemoryProfile, group: Group) -> float:
    """No group step is faster than the reference's work with every flop at the group's precision, unrecomputed,
    and the smallest share of the optimizer's work any layout leaves on the device. A full-precision group does
    none of a mixed reference's casts (autocast's copies of weights and inputs)."""
    work = reference.work(("forward", "backward"))
    flops = work.flops
    half = group.precision != "32-true"
    size = batch_size(search.batch)
    share = 1.0 if group.micro_batch_size is None else group.micro_batch_size / size
    uncast = not half and reference.precision != "32-true"
    written = work.bytes_written - (work.cast_bytes if uncast else 0.0)
    micro = Work(
        half_flops=flops * share if half else 0.0,
        full_flops=0.0 if half else flops * share,
        bytes_written=written * share * (0.5 if half and reference.precision == "32-true" else 1.0),
        kernels=work.kernels - (work.cast_kernels if uncast else 0.0),
    )
    knobs = Knobs(group.precision, group.attn_impl, micro_batch_size=group.micro_batch_size)
    least = min(search.traffic(replace(knobs, shards=layout.shards)).optimizer_share for layout in search.layouts)
    on_device = 0.0 if any(layout.cpu_offload for layout in search.layouts) else least
    traffic = ShardedTraffic(0.0, 0.0, on_device)
    return step_cost(
        micro, reference.work(("optimizer",)), search.hardware, search.micro_batches(knobs), traffic=traffic
    ).total


def check_model_states(search: SearchContext, anchor: MemoryProfile, options: Sequence[ResultChangingOption]) -> None:
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
