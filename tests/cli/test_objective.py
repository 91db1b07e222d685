"""What memopt-train returns to a sweeper: `objective=auto` (the task's validation metric), a named metric, null."""

import subprocess
import sys

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule

from lightning_memopt.arguments import InputError
from lightning_memopt.cli.objective import Objective, check_sweeper_direction, objective_value, resolve_objective
from lightning_memopt.cli.train import build_run, fit, job_result
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule, TrackingModule
from tests.helpers import TINY_FACE


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        (FaceRecognitionModule, Objective("val/acc", "max", given=False)),
        (NormalEstimationModule, Objective("val/mean_angle", "min", given=False)),
        (TrackingModule, Objective("val/delta_avg", "max", given=False)),
        (LightningModule, Objective("val/loss", "min", given=False)),  # a module of the user's: its val/loss
    ],
)
def test_auto_is_the_validation_metric_the_task_declares(task, expected):
    assert resolve_objective("auto", task) == expected


def test_a_named_metric_keeps_a_direction_only_where_it_is_known():
    assert resolve_objective("val/acc", FaceRecognitionModule) == Objective("val/acc", "max", given=True)
    assert resolve_objective("train/loss", FaceRecognitionModule) == Objective("train/loss", None, given=True)
    assert resolve_objective(None, FaceRecognitionModule) is None
    assert Objective("val/acc", "max", True).describe(0.5) == "val/acc = 0.5000 (higher is better)"
    assert Objective("train/loss", None, True).describe(2.0) == "train/loss = 2.0000"


@pytest.mark.parametrize("bad", [3, "", ["val/acc"]])
def test_an_objective_that_is_no_metric_name_is_refused(bad):
    with pytest.raises(TypeError, match=r"`objective` must be a logged metric's name"):
        resolve_objective(bad, FaceRecognitionModule)


def test_a_malformed_declaration_is_refused_naming_the_class():
    class Declares(LightningModule):
        validation_objective = ("val/f1", "up")

    with pytest.raises(TypeError, match=r"`Declares.validation_objective` must be \(metric, 'max' \| 'min'\)"):
        resolve_objective("auto", Declares())


def test_a_named_metric_never_logged_is_a_bad_input_listing_the_logged_ones():
    metrics = {"train/loss": torch.tensor(1.5), "val/loss": torch.tensor(2.0)}
    with pytest.raises(InputError, match=r"`objective`='val/accc' was never logged .*: train/loss, val/loss"):
        objective_value(Objective("val/accc", None, given=True), metrics)
    assert objective_value(Objective("val/acc", "max", given=False), metrics) is None  # auto: said by the caller
    assert objective_value(Objective("val/loss", "min", given=True), metrics) == 2.0


def test_a_run_returns_its_validation_accuracy_by_default(compose_train, caplog):
    run = build_run(compose_train(*TINY_FACE))
    fit(run)
    value = job_result(run)
    assert value == float(run.trainer.callback_metrics["val/acc"])
    assert f"memopt-train: objective val/acc = {value:.4f} (higher is better)" in caplog.text


def test_a_run_without_validation_returns_nothing_and_says_why(compose_train):
    run = build_run(compose_train(*TINY_FACE, "trainer.limit_val_batches=0"))
    fit(run)
    with pytest.warns(UserWarning, match=r"`objective=auto` is val/acc, which this fit never logged"):
        assert job_result(run) is None
    run = build_run(compose_train(*TINY_FACE, "trainer.limit_val_batches=0", "objective=train/loss"))
    fit(run)
    assert job_result(run) == float(run.trainer.callback_metrics["train/loss"])


@pytest.mark.slow
def test_an_optuna_sweep_optimises_the_validation_metric(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    command = [
        sys.executable,
        "-m",
        "lightning_memopt.train",
        "sweep=optuna",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "logger=none",
        *TINY_FACE,
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    returned = [
        float(line.split("val/acc = ")[1].split()[0]) for line in output.splitlines() if "objective val/acc" in line
    ]
    assert len(returned) == 2
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["name"] == "optuna" and best["best_value"] == pytest.approx(max(returned), abs=1e-4)


@pytest.mark.parametrize(
    ("objective", "direction", "refused"),
    [
        (Objective("val/acc", "max", given=False), "maximize", False),
        (Objective("val/mean_angle", "min", given=False), "maximize", True),
        (Objective("val/loss", "min", given=True), "minimize", False),
        (Objective("val/loss", "min", given=True), "Direction.maximize", True),  # an enum's name
        (Objective("train/loss", None, given=True), "maximize", False),  # which way is better is not known
        (Objective("val/acc", "max", given=False), ["maximize", "minimize"], False),  # multi-objective: not ours
        (None, "minimize", False),
    ],
)
def test_a_sweeper_that_would_optimise_the_wrong_way_is_refused(objective, direction, refused):
    if not refused:
        check_sweeper_direction(objective, direction)
        return
    with pytest.raises(ValueError, match=r"`hydra.sweeper.direction`=.* set hydra.sweeper.direction=minimize"):
        check_sweeper_direction(objective, direction)
