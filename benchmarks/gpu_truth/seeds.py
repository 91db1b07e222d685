"""gpu_truth.py's seed rows: the runs users could not fit, planned for their GPU and run on a device capped to it.

Each seed is a run reported in the field (``shared/reference/PRESETS.md``): CoTracker2 on Kubric-size clips
(24 frames, 768 tracks, 384×512) on a 24 GB RTX 3090, Sapiens-2B surface normals at 1024×768 on an 80 GB
A800, r100 with TopoFR's loss at batch 32 on a 32 GB V100. The planner makes the plan ``memopt-plan`` makes
for that GPU (its catalogue entry: memory and rates; one device, no CPU offload, which needs
``fsdp_memopt``), in a worker process while the other sections measure; the run then applies it
(``MemoryBudget(knobs=...)``) for a few steps on this device capped to that GPU's memory: it must fit, and
its real peak is set beside the predicted one, with the steps per second. A cap above this device's memory
cannot be run here, and the row says so.

Example::

    >>> [seed.gpu for seed in SEEDS["dry"]]
    ['rtx3090_24gb', 'a800_80gb', 'v100_32gb']
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_memopt.callbacks import MemoryBudget
from lightning_memopt.planner import gpu, plan

from .cases import Case, face, normals, repeated, tracking
from .device import TruthDevice
from .rows import row


@dataclass(frozen=True)
class Seed:
    """A run reported in the field: ``case`` on the catalogue GPU ``gpu``, run for ``steps`` steps."""

    case: Case
    gpu: str
    steps: int = 3


_FULL = [
    Seed(tracking("cotracker2", 24, 768, 384, 512), "rtx3090_24gb"),
    Seed(normals("sapiens_2b", 1, 1024, 768), "a800_80gb"),
    Seed(face("r100", 32, topo_weight=0.1), "v100_32gb"),
]
SEEDS = {
    "full": _FULL,
    "quick": _FULL[2:],  # the planner's profiles of the other two take minutes
    "dry": [
        Seed(tracking("cotracker2_tiny", 8, 16, 64, 64), "rtx3090_24gb", steps=2),
        Seed(normals("sapiens_tiny", 1, 64, 48), "a800_80gb", steps=2),
        Seed(face("iresnet_tiny", 8, 32, topo_weight=0.1), "v100_32gb", steps=2),
    ],
}


def runs_here(device: TruthDevice, seed: Seed) -> bool:
    """Whether this device has the memory of the seed's GPU (a CPU's simulated device always has)."""
    return not device.is_cuda or gpu(seed.gpu).memory_bytes <= device.total_bytes


def planned_knobs(suite: str, index: int, on_cuda: bool) -> tuple[dict[str, Any] | None, int, str]:
    """The knobs ``memopt-plan`` picks for seed ``index`` of ``suite`` on its GPU (run in a worker), their
    predicted peak, and why nothing was chosen (empty when something was). Off CUDA (a dry run) the GPU's
    memory and rates, with the tensors as the CPU keeps them (no CUDA autocast lists, no library workspaces)."""
    torch.set_num_threads(1)
    seed = SEEDS[suite][index]
    hardware = gpu(seed.gpu) if on_cuda else replace(gpu(seed.gpu), device_type="cpu", workspace=None)
    result = plan(seed.case.build, seed.case.batch(), hardware, cpu_offload=(False,))
    if result.chosen is None:
        return None, 0, "no configuration fits: " + "; ".join(result.notes)
    return result.chosen.knobs.as_dict(), result.chosen.peak_bytes, ""


def seed_row(device: TruthDevice, seed: Seed, planned: tuple[dict[str, Any] | None, int, str] | None) -> dict:
    """The seed's planned run on this device capped to its GPU's memory (``planned``: :func:`planned_knobs`)."""
    cap = gpu(seed.gpu).memory_bytes - device.context_bytes  # that GPU's CUDA context takes its share as ours does
    variant = f"planned for {seed.gpu}"
    if planned is None:
        usable, needed = (device.total_bytes - device.context_bytes) / 2**30, gpu(seed.gpu).memory_bytes / 2**30
        note = (
            f"cannot run here: {seed.gpu} has {needed:.1f} GiB, {device.name} {usable:.1f} GiB beside its CUDA context"
        )
        return row("seeds", seed.case.name, variant, note=note)
    knobs, predicted, why_not = planned
    if knobs is None:
        return row("seeds", seed.case.name, variant, passed=False, note=why_not)
    device.release()
    torch.manual_seed(0)
    module = seed.case.build()
    budget = MemoryBudget(knobs=knobs)
    trainer = device.trainer(seed.steps, [budget])
    failure = ""
    with device.capped(cap, include=(module,)) as peak:
        started = time.perf_counter()
        try:
            trainer.fit(module, repeated(seed.case.batch(), seed.steps))
        except torch.OutOfMemoryError as error:
            failure = f"; ran out of memory: {str(error).splitlines()[0]}"
        device.synchronize()
        seconds = time.perf_counter() - started
    deviation = predicted / peak.allocated - 1 if peak.allocated else float("nan")
    return row(
        "seeds",
        seed.case.name,
        f"{variant}: {budget.knobs.describe() if budget.knobs else knobs}",
        predicted=predicted,
        peak=peak,
        deviation=deviation,
        seconds=seconds / seed.steps,
        passed=not failure and peak.held <= cap,  # it must fit; the deviation is shown, as the prediction rows check it
        note=f"device capped at {cap / 2**30:.1f} GiB; {seed.steps / seconds:.2f} steps/s (first step included)"
        f"{failure}",
    )
