"""A measured plan leaves the run exact: for each preset family, a fit after the trials ends bit-identical to the same
fit given the chosen knobs from the start — weights, buffers, optimizer and scheduler states, step count, every random
number generator, what reached the loggers and what the monitoring callbacks counted."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger

from lightning_memopt import MemoryBudget, MemoryMonitor, TrainingSummary
from lightning_memopt.data import SyntheticFaceDataModule, SyntheticNormalsDataModule, SyntheticTrackingDataModule
from lightning_memopt.random_generators import capture_random_state
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule, TrackingModule
from tests.helpers import quiet_trainer

FAMILIES = {  # a tiny preset of each family, with what draws random numbers: dropout, sampling, augmentation
    "iresnet": (
        lambda: FaceRecognitionModule(
            num_classes=8, backbone="iresnet_tiny", backbone_options={"input_size": 32, "dropout": 0.3}, sample_rate=0.5
        ),
        lambda: SyntheticFaceDataModule(
            num_classes=8, samples_per_class=3, val_samples_per_class=0, image_size=32, batch_size=8,
            augmentation={"hflip": 0.5, "rotation_degrees": 10},
        ),
    ),
    "sapiens": (
        lambda: NormalEstimationModule(backbone="sapiens_tiny", warmup_steps=2),
        lambda: SyntheticNormalsDataModule(num_samples=12, val_samples=0, image_size=(64, 48), batch_size=4),
    ),
    "cotracker": (
        lambda: TrackingModule(backbone="cotracker2_tiny", backbone_options={"iters": 2}),
        lambda: SyntheticTrackingDataModule(
            num_clips=6, val_clips=0, sequence_len=8, image_size=(64, 64), traj_per_sample=16, batch_size=2
        ),
    ),
}  # fmt: skip
TIMED = (
    "seconds",
    "per_second",
    "summary/peak_memory_bytes",
    "summary/peak_rss_bytes",
)  # wall time, and the process's RSS off CUDA


class _RecordingLogger(Logger):
    """Every metric the loggers received, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    name, version = "recording", 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # the plan's own values (its measuring time) differ by design

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, {k: v for k, v in metrics.items() if not any(t in k for t in TIMED)}))


def _fit(family: str, budget: MemoryBudget, root) -> dict:
    build_module, build_data = FAMILIES[family]
    pl.seed_everything(3)
    module, monitor, summary, logger = build_module(), MemoryMonitor(), TrainingSummary(print_summary=False), None
    logger = _RecordingLogger()
    trainer = quiet_trainer(
        max_steps=3,
        callbacks=[budget, monitor, summary],
        logger=logger,
        default_root_dir=root,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=build_data())
    return {
        "state": module.state_dict(),  # parameters and buffers (BatchNorm statistics)
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "random": capture_random_state(),
        "logged": logger.metrics,
        "monitored": {k: v for k, v in monitor.last_logged.items() if not any(t in k for t in TIMED)},
        "summary": (summary.summary.steps, summary.summary.samples, summary.summary.final_loss),
    }


def _differences(measured, given, where="") -> list[str]:
    if isinstance(measured, torch.Tensor):
        return [] if torch.equal(measured, given) else [where]
    if isinstance(measured, dict):
        if measured.keys() != given.keys():
            return [f"{where}: keys {sorted(set(measured) ^ set(given))}"]
        return [d for key in measured for d in _differences(measured[key], given[key], f"{where}.{key}")]
    if isinstance(measured, list | tuple):
        if len(measured) != len(given):
            return [f"{where}: {len(measured)} items against {len(given)}"]
        return [
            d for i, (a, b) in enumerate(zip(measured, given, strict=True)) for d in _differences(a, b, f"{where}[{i}]")
        ]
    return [] if measured == given else [f"{where}: {measured!r} against {given!r}"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_fit_after_its_trials_ends_as_the_same_fit_given_the_chosen_knobs(family, tmp_path):
    budget = MemoryBudget(
        safety_margin=0.0, measure="refresh", measure_candidates=3, measure_steps=1, measure_seconds=600, verify=0
    )
    measured = _fit(family, budget, tmp_path)
    tried = [m for m in budget.plan.measurements if m.outcome == "measured"]
    assert len(tried) == 3  # three trials ran, each on a copy: none may reach the run
    given = _fit(family, MemoryBudget(knobs=budget.knobs.as_dict()), tmp_path)
    assert measured["global_step"] == 3 and measured["logged"]
    assert _differences(measured, given) == []
