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

from dataclasses import dataclass

from lightning_memopt.checkpointing import SAVED_OP_NAMES
from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.work import Work

STEP_PHASES = ("forward", "backward")


@dataclass(frozen=True)
class StepEstimate:
    """A candidate's predicted peak, its breakdown, and the work and offload of one of its micro-batches."""

    peak_bytes: int
    breakdown: dict[str, int]
    step_work: Work
    optimizer_work: Work
    offloaded_bytes: float
    regions: int = 0  # checkpointed block calls per micro-batch
    region_kernels: float = 0.0  # the forward kernels inside them


def from_profile(profile: MemoryProfile, extra_bytes: int = 0) -> StepEstimate:
    """A profiled candidate as an estimate; ``extra_bytes`` join its forward/backward peak (accumulated gradients)."""
    step_peak = max(profile.phase_peaks.get(phase, 0) for phase in STEP_PHASES) + extra_bytes
    peak = max(step_peak, profile.phase_peaks.get("optimizer", 0), profile.phase_peaks.get("setup", 0))
    breakdown = dict(profile.breakdown)
    breakdown["gradients"] += extra_bytes if peak == step_peak else 0
    return StepEstimate(
        peak,
        breakdown,
        profile.work(STEP_PHASES),
        profile.work(("optimizer",)),
        float(profile.offloaded_bytes),
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
    saving = sum(freed.values()) - max(freed.values(), default=0)
    step_peak = max(anchor.phase_peaks.get(phase, 0) for phase in STEP_PHASES) + extra_bytes - saving
    peak = max(step_peak, anchor.phase_peaks.get("optimizer", 0), anchor.phase_peaks.get("setup", 0))
    breakdown = dict(anchor.breakdown)
    breakdown["activations"] = max(0, breakdown["activations"] - saving)
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
    return StepEstimate(peak, breakdown, step_work, anchor.work(("optimizer",)), offloaded, regions, region_kernels)


def _freed_bytes(anchor: MemoryProfile, block: str, mode: str) -> int:
    account = anchor.blocks.get(block)
    if account is None:
        return 0
    if mode == "selective":
        return account.saved_bytes - account.bytes_made_by(SAVED_OP_NAMES)
    if mode == "offload":  # every saved tensor leaves, the block inputs the next offloaded block saves too
        return account.saved_bytes + account.output_bytes
    return account.saved_bytes
