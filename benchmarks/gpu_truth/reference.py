"""gpu_truth.py's reference-batch rows: the README's memory table against two real training steps.

The README's table is ``memory_profile.py``'s fake-mode peak of every preset at its reference batch
(``REFERENCE_RUNS``: the Hydra overrides of each preset's published training batch). Each is predicted again
for this device (``memopt-profile``'s prediction: CUDA's autocast lists, this GPU's library workspaces) in
worker processes, and measured on the device: two training steps of the same model and batch, as the
prediction rows run them. The dry run takes the tiny presets on the CPU (tensors as the CPU keeps them).
Hydra composes the runs: it is imported when the section runs (a machine without it fails this section only).

Example::

    >>> sorted(runs("dry"))
    ['cotracker3_tiny', 'iresnet_tiny', 'sapiens_tiny']
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from lightning_memopt.planner import GPUS

from .cases import Case
from .device import TruthDevice
from .memory import PREDICTION_TOLERANCE, measured_peak
from .rows import row

DRY_RUNS = {
    "iresnet_tiny": ["model=iresnet_tiny", "data.num_classes=8", "data.image_size=32", "data.batch_size=4"],
    "sapiens_tiny": [
        "experiment=sapiens_2b_normal",
        "model=sapiens_tiny",
        "data.num_samples=2",
        "data.image_size=[64,48]",
        "data.batch_size=2",
    ],
    "cotracker3_tiny": [
        "experiment=cotracker3_online",
        "model=cotracker3_tiny",
        "data.num_clips=1",
        "data.val_clips=0",
        "data.image_size=[64,64]",
        "data.sequence_len=8",
        "data.traj_per_sample=16",
    ],
}


def runs(suite: str) -> dict[str, list[str]]:
    """The presets of ``suite`` and their overrides: every reference run (full), one per family (quick)."""
    if suite == "dry":
        return DRY_RUNS
    from claims.memory_profile import REFERENCE_RUNS

    if suite == "quick":
        return {name: REFERENCE_RUNS[name] for name in ("r50", "sapiens_0.3b", "cotracker3")}
    return REFERENCE_RUNS


def _config(suite: str, preset: str, precision: str, gpu: str | None) -> Any:
    from claims.memory_profile import PRECISIONS
    from hydra import compose, initialize_config_dir

    from lightning_memopt.cli.config import config_dir

    device = [f"profile.gpu={gpu}"] if gpu is not None else ["profile.device_type=cpu"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("profile", overrides=[*runs(suite)[preset], PRECISIONS[precision], "trainer=cpu", *device])


def predicted_peak(suite: str, preset: str, precision: str, gpu: str | None) -> int:
    """``memopt-profile``'s prediction of the reference run (in a worker) for the catalogue GPU ``gpu`` (None: CPU)."""
    from lightning_memopt.cli.profile import profile

    torch.set_num_threads(1)
    return profile(_config(suite, preset, precision, gpu)).peak_bytes


def reference_rows(device: TruthDevice, suite: str, workers: int) -> list[dict]:
    """One row per reference run and precision: predicted against the allocator's peak of two real steps."""
    from claims.memory_profile import PRECISIONS

    from lightning_memopt.cli.plan_config import first_batch, instantiate_model

    gpu = None  # the CPU: tensors as it keeps them
    if device.is_cuda:  # this GPU's catalogue entry (a board the catalogue lacks: priced as cuda_hardware prices it)
        gpu = device.hardware().name if device.hardware().name in GPUS else "a100_80gb"
    jobs = [(preset, precision) for preset in runs(suite) for precision in PRECISIONS]
    rows = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {job: pool.submit(predicted_peak, suite, *job, gpu) for job in jobs}
        for (preset, precision), future in futures.items():
            cfg = _config(suite, preset, precision, gpu)
            case = Case(preset, preset, lambda cfg=cfg: instantiate_model(cfg.model), lambda cfg=cfg: first_batch(cfg))
            variant, predicted = f"{precision}, batch {cfg.data.batch_size}", future.result()
            usable = device.total_bytes - device.context_bytes
            if device.is_cuda and predicted > usable:
                note = f"predicted {predicted / 2**30:.1f} GiB: more than this device's {usable / 2**30:.1f} GiB"
                rows.append(row("reference batch", preset, variant, predicted=predicted, note=note))
                continue
            try:
                peak, _ = measured_peak(device, case, "bf16-mixed" if precision == "bf16-mixed" else "32-true", None)
            except torch.OutOfMemoryError as error:  # one row fails, the others are measured
                device.release()
                note = f"ran out of memory: {str(error).splitlines()[0]}"
                rows.append(row("reference batch", preset, variant, predicted=predicted, passed=False, note=note))
                continue
            deviation = predicted / peak.allocated - 1
            rows.append(
                row(
                    "reference batch",
                    preset,
                    variant,
                    predicted=predicted,
                    peak=peak,
                    deviation=deviation,
                    passed=abs(deviation) <= PREDICTION_TOLERANCE,
                )
            )
    return rows
