"""Estimate a checkpointing candidate from the profile of the same step without checkpointing (the anchor).

The anchor's profile says what each block's forward leaves alive for the backward pass and what
its forward costs. Each block is checkpointed in a mode of its own. Checkpointing a block frees
what it left (full: everything; offload: that and its outputs, which the next offloaded block
saves; selective: everything but the matmul, convolution and attention outputs), re-materialises
it while that block's backward runs, and adds
its forward again (full), its cheap ops (selective) or a copy to the host and back (offload), plus
the host-side cost of each checkpointed call. The planner confirms the estimate it picks with a
profile of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_memopt.checkpointing import SAVED_OP_NAMES, LeanRecompute
from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.tracker import CATEGORIES, PARAMETER_CAST
from lightning_memopt.memory.work import Work
from lightning_memopt.planner.offload_price import OffloadedBlock, offloaded_blocks
from lightning_memopt.vocabulary import LEAN

STEP_PHASES = ("forward", "backward")
# the moments a step's memory is known at: each phase's peak, and the backward pass at its most bytes other than
# gradients (the peak once gradients are sharded, when the unsharded one is late in backward with most of them)
STEP_MOMENTS = ("forward", "backward", "backward less gradients")
# ... and where backward ends (every gradient there, the activations gone): checkpointing does not change it
MOMENTS = ("setup", *STEP_MOMENTS, "backward end", "optimizer")


@dataclass(frozen=True)
class StepEstimate:
    """A candidate's device memory at the moments of :data:`MOMENTS`, its host memory, and the work of a micro-batch.

    ``phases`` holds the device bytes by category at each moment (the peaks of setup, forward,
    backward and the optimizer step, and the backward pass at its most bytes other than
    gradients); the peak is the largest of them. ``parameter_casts`` are the bytes of parameters
    cast to the compute dtype by autocast alive at the step's moments (part of their
    activations). ``host`` is host memory at its peak, by category.
    """

    phases: dict[str, dict[str, int]]
    step_work: Work
    optimizer_work: Work
    offloaded_bytes: float  # activation bytes one micro-batch offloads to the host
    # by checkpointing mode: the checkpointed block calls per micro-batch and the forward ops inside them
    regions: dict[str, tuple[int, float]] = field(default_factory=dict)
    parameter_casts: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    # where blocks offload: every block in forward order, its work and what it offloads (the copy schedule's input)
    copies: tuple[OffloadedBlock, ...] = ()

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: sum(self.phases[phase].values()), default="setup")

    @property
    def peak_bytes(self) -> int:
        return sum(self.phases.get(self.peak_phase, {}).values())

    @property
    def breakdown(self) -> dict[str, int]:
        """Device bytes by category at the peak."""
        return dict(self.phases.get(self.peak_phase, dict.fromkeys(CATEGORIES, 0)))

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def from_profile(profile: MemoryProfile, extra_bytes: int = 0) -> StepEstimate:
    """A profiled candidate as an estimate; ``extra_bytes`` join its forward/backward gradients (accumulated ones)."""
    phases = {
        moment: dict(profile.phase_breakdowns[moment]) for moment in MOMENTS if moment in profile.phase_breakdowns
    }
    for moment in (*STEP_MOMENTS, "backward end"):
        if moment in phases:
            phases[moment]["gradients"] += extra_bytes
    offloaded = float(profile.offloaded_bytes)
    return StepEstimate(
        phases,
        profile.work(STEP_PHASES),
        profile.work(("optimizer",)),
        offloaded,
        parameter_casts={moment: profile.parameter_casts.get(moment, 0) for moment in STEP_MOMENTS},
        host={"activations": int(offloaded)} if offloaded else {},
    )


def checkpointed(
    anchor: MemoryProfile,
    modes: Mapping[str, str],
    extra_bytes: int = 0,
    lean: Mapping[str, LeanRecompute] | None = None,
) -> StepEstimate:
    """Estimate checkpointing each block of ``modes`` in its mode (``"full"``, ``"selective"``, ``"offload"``,
    ``"lean"``).

    ``lean``: the blocks with a lean recomputation of their own, and its cost (used in ``"lean"`` mode).

    Example::

        >>> import torch
        >>> from lightning_memopt.memory import profile_step
        >>> from lightning_memopt.models import create_model
        >>> names = ("backbone.blocks.0", "backbone.blocks.1")
        >>> anchor = profile_step(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48), mode="fake",
        ...     loss_fn=lambda m, x: m(x).square().mean(), optimizer=lambda p: torch.optim.AdamW(p),
        ...     steps=1, warm_optimizer=True, blocks=names)
        >>> full = checkpointed(anchor, dict.fromkeys(names, "full"))
        >>> mixed = checkpointed(anchor, {names[0]: "full", names[1]: "selective"})
        >>> full.peak_bytes < mixed.peak_bytes < from_profile(anchor).peak_bytes
        True
    """
    lean = lean or {}
    freed = freed_bytes(anchor, modes)
    # forward ends with all of it freed; in backward one block at a time holds its part again
    held = {name: held_bytes(anchor, name, nbytes, modes[name], lean.get(name)) for name, nbytes in freed.items()}
    savings = {"forward": sum(freed.values())}
    saving = sum(freed.values()) - max(held.values(), default=0)
    # the parameter casts the checkpointed blocks kept are freed with them (recomputed in backward)
    casts_freed = sum(anchor.blocks[name].by_op.get(PARAMETER_CAST, 0) for name in modes if name in anchor.blocks)
    base = from_profile(anchor, extra_bytes)
    phases = {phase: dict(breakdown) for phase, breakdown in base.phases.items()}
    casts = dict(base.parameter_casts)
    for moment in STEP_MOMENTS:
        if moment in phases:
            activations = phases[moment]["activations"]
            phases[moment]["activations"] = max(0, activations - savings.get(moment, saving))
            casts[moment] = max(0, min(casts.get(moment, 0) - casts_freed, phases[moment]["activations"]))
    recompute = Work()
    for name, mode in modes.items():
        recompute = recompute + recomputed_work(anchor.work(("forward",), (name,)), mode, lean.get(name))
    offloaded = float(sum(nbytes for name, nbytes in freed.items() if modes[name] == "offload"))
    return StepEstimate(
        phases,
        anchor.work(STEP_PHASES) + recompute,
        anchor.work(("optimizer",)),
        offloaded,
        checkpointed_regions(anchor, modes),
        parameter_casts=casts,
        host={"activations": int(offloaded)} if offloaded else {},
        copies=copy_schedule(anchor, modes, lean),
    )


def copy_schedule(
    anchor: MemoryProfile, modes: Mapping[str, str], lean: Mapping[str, LeanRecompute] | None = None
) -> tuple[OffloadedBlock, ...]:
    """The anchor's blocks in forward order with what checkpointing them in ``modes`` offloads and recomputes, for
    the copy schedule (:mod:`~lightning_memopt.planner.offload_price`); empty when ``modes`` offloads nothing.

    Example::

        >>> copy_schedule(None, {"blocks.0": "full"})   # nothing offloaded: no copies to schedule
        ()
    """
    if "offload" not in modes.values():
        return ()
    lean = lean or {}
    freed = freed_bytes(anchor, modes)
    forwards = {name: anchor.work(("forward",), (name,)) for name in anchor.blocks}
    forward, backward = anchor.work(("forward",)), anchor.work(("backward",))
    ratio = backward.flops / forward.flops if forward.flops else backward.kernels / max(forward.kernels, 1.0)
    again = {name: recomputed_work(forwards[name], mode, lean.get(name)) for name, mode in modes.items()}
    offloaded = {name: freed[name] for name, mode in modes.items() if mode == "offload"}
    return offloaded_blocks(forwards, ratio, offloaded, again)


def checkpointed_regions(anchor: MemoryProfile, modes: Mapping[str, str]) -> dict[str, tuple[int, float]]:
    """By mode: the calls of the blocks ``modes`` checkpoints in it and the ops of their forward (``anchor``'s, a
    profile that tracked them): what the host's Python work of checkpointing grows with."""
    regions: dict[str, tuple[int, float]] = {}
    for name, mode in modes.items():
        calls, ops = regions.get(mode, (0, 0.0))
        account = anchor.blocks.get(name)  # absent: never called
        forward = anchor.work(("forward",), (name,)).ops
        regions[mode] = (calls + (account.calls if account is not None else 0), ops + forward)
    return regions


def recomputed_work(forward: Work, mode: str, lean: LeanRecompute | None = None) -> Work:
    """What checkpointing a block in ``mode`` runs again, given its ``forward`` work (and, in ``"lean"`` mode, its lean
    recomputation: without one, ``"lean"`` is ``"full"``)."""
    if mode == LEAN and lean is not None:
        return forward.scaled(lean.forwards)
    if mode in ("full", LEAN):
        return forward
    return forward.without_matmuls() if mode == "selective" else Work()


def held_bytes(anchor: MemoryProfile, block: str, freed: int, mode: str, lean: LeanRecompute | None = None) -> int:
    """What ``block``, freeing ``freed`` bytes in ``mode``, holds again at once while its backward runs: recomputed,
    all of it and its output (in ``"lean"`` mode, a lean recomputation its share); offloaded, all of it, and
    meanwhile the next block's copies come back ahead of its backward (taken to be as large)."""
    account = anchor.blocks.get(block)
    if mode == "offload":
        return 2 * freed  # its copies back, and those of the block backward reaches next (prefetched meanwhile)
    if lean is not None and mode == LEAN:
        return int(freed * lean.held_fraction)
    # recomputed in one piece, the block makes its output again too (its backward starts from it)
    return freed + (account.output_bytes if account is not None else 0)


def freed_bytes(anchor: MemoryProfile, modes: Mapping[str, str]) -> dict[str, int]:
    """The device bytes each block of ``modes`` frees until its backward runs, by block.

    Full checkpointing frees what the block saved; selective all but the outputs of matmul,
    convolution and attention ops; offload every saved tensor, and the block's output too where the
    next block (in the anchor's order) is offloaded as well or none follows (it saves that output).
    """
    order = list(anchor.blocks)
    following = {name: order[index + 1] if index + 1 < len(order) else None for index, name in enumerate(order)}
    freed = {}
    for name, mode in modes.items():
        account = anchor.blocks.get(name)
        if account is None:
            freed[name] = 0
        elif mode == "selective":
            freed[name] = account.saved_bytes - account.bytes_made_by(SAVED_OP_NAMES)
        elif mode == "offload":
            after = following[name]
            moves_output = after is None or modes.get(after) == "offload"
            freed[name] = account.saved_bytes + (account.output_bytes if moves_output else 0)
        else:
            freed[name] = account.saved_bytes
    return freed
