"""Estimate a checkpointing candidate from the profile of the same step without checkpointing (the anchor).

The anchor's profile says what each preset block's forward leaves alive for the backward pass and
what its forward costs. Checkpointing a block frees what it left (full: everything; offload: that
and its outputs, which the next offloaded block saves; selective: everything but the matmul,
convolution and attention outputs), re-materialises it while that block's backward runs, and adds
its forward again (full), its cheap ops (selective) or a copy to the host and back (offload), plus
the host-side cost of each checkpointed call. The planner confirms the estimate it picks with a
profile of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_memopt.checkpointing import SAVED_OP_NAMES
from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.tracker import CATEGORIES, PARAMETER_CAST
from lightning_memopt.memory.work import Work

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
    regions: int = 0  # checkpointed block calls per micro-batch
    region_kernels: float = 0.0  # the forward kernels inside them
    parameter_casts: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

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


def checkpointed(anchor: MemoryProfile, blocks: list[str], mode: str, extra_bytes: int = 0) -> StepEstimate:
    """Estimate checkpointing ``blocks`` in ``mode`` (``"full"``, ``"selective"`` or ``"offload"``) from ``anchor``.

    Example::

        >>> import torch
        >>> from lightning_memopt.memory import profile_step
        >>> from lightning_memopt.models import create_model
        >>> names = ("backbone.blocks.0", "backbone.blocks.1")
        >>> anchor = profile_step(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48), mode="fake",
        ...     loss_fn=lambda m, x: m(x).square().mean(), optimizer=lambda p: torch.optim.AdamW(p),
        ...     steps=1, warm_optimizer=True, blocks=names)
        >>> checkpointed(anchor, list(names), "full").peak_bytes < from_profile(anchor).peak_bytes
        True
    """
    freed = {name: _freed_bytes(anchor, name, mode) for name in blocks}
    # forward ends with all of it freed; in backward one block at a time holds its part again
    savings = {"forward": sum(freed.values())}
    saving = sum(freed.values()) - max(freed.values(), default=0)
    # the parameter casts the checkpointed blocks kept are freed with them (recomputed in backward)
    casts_freed = sum(anchor.blocks[name].by_op.get(PARAMETER_CAST, 0) for name in blocks if name in anchor.blocks)
    base = from_profile(anchor, extra_bytes)
    phases = {phase: dict(breakdown) for phase, breakdown in base.phases.items()}
    casts = dict(base.parameter_casts)
    for moment in STEP_MOMENTS:
        if moment in phases:
            activations = phases[moment]["activations"]
            phases[moment]["activations"] = max(0, activations - savings.get(moment, saving))
            casts[moment] = max(0, min(casts.get(moment, 0) - casts_freed, phases[moment]["activations"]))
    recompute = Work()
    for name in blocks:
        forward = anchor.work(("forward",), (name,))
        recompute = recompute + (
            forward if mode == "full" else forward.without_matmuls() if mode == "selective" else Work()
        )
    offloaded = float(sum(freed.values())) if mode == "offload" else 0.0
    regions = sum(anchor.blocks[name].calls for name in blocks if name in anchor.blocks)  # absent: never called
    region_kernels = anchor.work(("forward",), tuple(blocks)).kernels
    step_work = anchor.work(STEP_PHASES) + recompute
    return StepEstimate(
        phases,
        step_work,
        anchor.work(("optimizer",)),
        offloaded,
        regions,
        region_kernels,
        parameter_casts=casts,
        host={"activations": int(offloaded)} if offloaded else {},
    )


def _freed_bytes(anchor: MemoryProfile, block: str, mode: str) -> int:
    account = anchor.blocks.get(block)
    if account is None:
        return 0
    if mode == "selective":
        return account.saved_bytes - account.bytes_made_by(SAVED_OP_NAMES)
    if mode == "offload":  # every saved tensor leaves, the block inputs the next offloaded block saves too
        return account.saved_bytes + account.output_bytes
    return account.saved_bytes
