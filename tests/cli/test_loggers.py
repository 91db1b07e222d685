"""Every logger config of memopt-train receives the run's metrics: CSV, TensorBoard, MLflow, W&B (offline)."""

import csv
from pathlib import Path

import pytest

from lightning_memopt.cli.config import finish_logger_runs
from lightning_memopt.cli.train import train
from tests.helpers import TINY_FACE


def test_one_run_logs_to_every_logger_at_once(compose_train, tmp_path):
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    cfg = compose_train(
        "logger=[csv,tensorboard,mlflow,wandb]",
        "logger.wandb.offline=true",
        f"paths.log_dir={tmp_path / 'logs'}",
        *TINY_FACE,
        "trainer.log_every_n_steps=1",
    )
    train(cfg)

    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        logged = {key for row in csv.DictReader(handle) for key, value in row.items() if value}
    assert {"train/loss", "val/loss"} <= logged

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [0, 1]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lightning_memopt").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1]

    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"train/loss" in wandb_run.read_bytes()  # the offline record `wandb sync` uploads


def test_each_job_of_a_multirun_logs_a_wandb_run_of_its_own(compose_train):
    pytest.importorskip("wandb")
    for _ in range(2):  # the basic launcher runs a sweep's jobs one after another in one process
        cfg = compose_train("logger=wandb", "logger.wandb.offline=true", *TINY_FACE)
        train(cfg)
        output_dir = Path(cfg.paths.output_dir)
    assert len(list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 2


def test_a_failed_fit_marks_its_wandb_run_failed(monkeypatch):
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    finished = []
    monkeypatch.setattr(wandb, "run", object())  # a run in progress
    monkeypatch.setattr(wandb, "finish", lambda exit_code=None: finished.append(exit_code))
    assert finish_logger_runs([CSVLogger("unused")], exit_code=1) == 0  # no W&B logger: nothing to finish
    assert finish_logger_runs([WandbLogger(offline=True)], exit_code=1) == 1
    assert finished == [1]
