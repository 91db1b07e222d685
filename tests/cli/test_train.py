import csv
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.train import train
from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import REPO_ROOT, TINY_FACE, run_memopt_train, tiny_overrides

CONF = Path(config_dir())
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_default_run_is_r18_on_synthetic_faces_on_the_cpu(compose_train):
    cfg = compose_train()
    assert cfg.model.backbone == "r18"
    assert cfg.data._target_ == "lightning_memopt.data.SyntheticFaceDataModule" and cfg.data.image_size == 112
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.max_steps > 0
    assert cfg.memopt.callbacks == {}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_a_fast_cpu_run(compose_train, experiment):
    cfg = compose_train(f"experiment={experiment}", *tiny_overrides(compose_train(f"experiment={experiment}")))
    summary = train(cfg)
    assert summary.steps == 2 and summary.samples == 2 * cfg.data.batch_size
    assert summary.final_loss is not None and summary.final_loss > 0


def test_experiments_hold_the_published_settings(compose_train):
    cfg = compose_train("experiment=arcface_r100_ms1mv2")
    assert (cfg.model.backbone, cfg.data.num_classes, cfg.data.batch_size) == ("r100", 85742, 128)
    assert list(cfg.model.margin_list) == [1.0, 0.5, 0.0] and cfg.trainer.precision == "16-mixed"
    cfg = compose_train("experiment=partialfc_r100_glint360k")
    assert (cfg.data.num_classes, cfg.model.sample_rate) == (360232, 0.1)
    assert list(compose_train("experiment=cosface_r50_ms1mv3").model.margin_list) == [1.0, 0.0, 0.4]
    cfg = compose_train("experiment=topofr_r100")
    assert (cfg.model.backbone, cfg.data.num_classes, cfg.data.batch_size) == ("r100", 85742, 128)
    assert (cfg.model.topo_weight, cfg.model.hard_sample_weighting, list(cfg.model.margin_list)) == (
        0.1,
        True,
        [1.0, 0.5, 0.0],
    )


def test_train_writes_metrics_and_a_resumable_checkpoint(compose_train, tmp_path):
    train(compose_train(*TINY_FACE))
    metrics = list(tmp_path.glob("csv/version_*/metrics.csv"))
    assert len(metrics) == 1
    with metrics[0].open() as f:
        rows = list(csv.DictReader(f))
    assert {"train/loss", "val/loss", "val/acc"} <= set(rows[0])
    checkpoint = next(tmp_path.glob("csv/version_*/checkpoints/*.ckpt"))
    resumed = train(compose_train(*TINY_FACE, "trainer.max_steps=4", f"ckpt_path='{checkpoint}'"))
    assert resumed.steps == 4 and resumed.samples == 16  # two more steps, not four


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.backbone=r999", r"Unknown model preset `name`='r999'; valid names: .*r18"),
        ("model.margin_list=[1.0,0.5]", r"`margin_list` must be three numbers"),
        ("model.sample_rate=1.5", r"`sample_rate`=1.5 must be in \(0, 1\]"),
        ("model.optimizer=lamb", r"Unknown `optimizer`='lamb'"),
    ],
)
def test_bad_configs_fail_with_a_clear_message(compose_train, override, message):
    with pytest.raises(Exception, match=message):
        train(compose_train(*TINY_FACE, override))


def test_a_callback_without_target_is_named(compose_train):
    with pytest.raises(ValueError, match=r"`callbacks.oops` must be a config with a `_target_`"):
        train(compose_train(*TINY_FACE, "+callbacks.oops.every_n=3"))


@pytest.mark.slow
def test_memopt_train_with_no_arguments_runs_the_default_experiment(tmp_path):
    result = run_memopt_train([], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "memopt-train summary" in output
    assert "optimizer steps   20" in output
    assert "samples/s" in output and "final train loss" in output and "peak memory" in output
    assert list(tmp_path.glob("logs/train/runs/*/csv/version_0/metrics.csv"))


def test_multirun_over_batch_size_produces_two_runs(tmp_path):
    args = ["-m", *TINY_FACE, "data.batch_size=4,8", "trainer.max_steps=2"]
    result = run_memopt_train(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(tmp_path.glob("logs/train/multiruns/*/*/.hydra/overrides.yaml"))
    assert len(runs) == 2
    batch_sizes = {o for run in runs for o in OmegaConf.load(run) if o.startswith("data.batch_size=")}
    assert batch_sizes == {"data.batch_size=4", "data.batch_size=8"}
    assert len(list(tmp_path.glob("logs/train/multiruns/*/*/csv/version_0/metrics.csv"))) == 2


@pytest.mark.slow
def test_sweep_config_runs_the_margin_comparison(tmp_path):
    result = run_memopt_train(["sweep=margins", *TINY_FACE], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    configs = sorted(tmp_path.glob("logs/train/multiruns/*/*/.hydra/config.yaml"))
    margins = sorted(tuple(OmegaConf.load(c).model.margin_list) for c in configs)
    assert margins == [(1.0, 0.0, 0.4), (1.0, 0.5, 0.0), (1.35, 0.0, 0.0)]


def test_module_entry_point_matches_console_script():
    from lightning_memopt import train as module_entry
    from lightning_memopt.cli import train as cli_train

    assert module_entry.main is cli_train.main
    assert "memopt-train = lightning_memopt.cli.train:main" in (REPO_ROOT / "setup.cfg").read_text()
    assert sys.modules["lightning_memopt.train"]


def test_model_config_builds_the_face_module(compose_train):
    from hydra.utils import instantiate

    model = instantiate(compose_train("model=iresnet_tiny", "data.image_size=32").model)
    assert isinstance(model, FaceRecognitionModule) and model.head.num_classes == 100


@pytest.mark.distributed
def test_ddp_on_two_cpu_processes_trains_and_counts_both_ranks(tmp_path):
    args = [*TINY_FACE, "strategy=ddp", "trainer.devices=2", "data.batch_size=4"]
    result = run_memopt_train(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "samples           16  (all ranks)" in result.stdout  # 2 steps × 4 samples × 2 ranks
    assert len(list(tmp_path.glob("logs/train/runs/*"))) == 1


def test_multirun_refuses_ddp_that_would_relaunch_the_sweep(tmp_path):
    args = ["-m", *TINY_FACE, "strategy=ddp", "trainer.devices=2", "data.batch_size=4,8"]
    result = run_memopt_train(args, cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert "cannot run inside a Hydra multirun (-m)" in result.stderr


def test_memopt_auto_that_fits_nothing_exits_with_its_reason_and_no_traceback(tmp_path):
    budget = "memopt.callbacks.memory_budget.budget=0.00001"  # GiB: less than the model states
    result = run_memopt_train([*TINY_FACE, "memopt=auto", budget], cwd=tmp_path)
    assert result.returncode == 2
    assert "memopt-train: MemoryBudget: the budget" in result.stderr
    assert "is smaller than the model states alone" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_strategy_option_exits_with_its_reason_and_no_traceback(tmp_path):
    args = [*TINY_FACE, "strategy=fsdp_memopt", "trainer.strategy.param_dtype=fp8"]
    result = run_memopt_train(args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert (
        "memopt-train: MemoptFSDPStrategy: unknown `trainer.strategy.param_dtype`='fp8'; valid choices: auto"
        in result.stderr
    )
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
