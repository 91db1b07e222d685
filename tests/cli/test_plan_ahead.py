"""memopt-train plans MemoryBudget before its Trainer exists, from the model and data it has built."""

import re

import pytest
import torch

from lightning_memopt import MemoryBudget
from lightning_memopt.callbacks import memory_budget
from lightning_memopt.cli.plan_ahead import run_target
from lightning_memopt.cli.train import build_run, fit
from lightning_memopt.planner import Knobs
from tests.helpers import TINY_FACE, TINY_NORMALS, run_memopt_train

_BUDGET = "memopt.callbacks.memory_budget.budget"
NORMALS = ["model=sapiens_tiny", "data=synthetic_normals", *TINY_NORMALS]


def test_memopt_auto_plans_before_the_trainer_and_setup_applies_that_plan(compose_train, monkeypatch):
    run = build_run(compose_train(*NORMALS, "memopt=auto", f"{_BUDGET}=1.0", "logger=csv"))
    (budget,) = [c for c in run.trainer.callbacks if isinstance(c, MemoryBudget)]
    assert budget.plan is not None and budget.plan.chosen is not None and budget.knobs is None
    planned = budget.plan.chosen.knobs
    monkeypatch.setattr(memory_budget, "training_dataloader", lambda trainer: pytest.fail("planned in setup"))
    summary = fit(run)
    assert budget.knobs == planned and summary.steps == 2
    logged = run.trainer.logger.experiment.hparams  # the plan's hyperparameters, as before
    assert logged["memopt/plan/precision"] == planned.precision and logged["memopt/plan/fits"] is True


def test_memopt_auto_measures_by_the_same_rule_and_logs_how_long_it_took(compose_train):
    measure = "memopt.callbacks.memory_budget.measure"
    overrides = [f"{_BUDGET}=1.0", f"{measure}=true", f"{measure}_candidates=2", "logger=csv"]
    run = build_run(compose_train(*NORMALS, "memopt=auto", *overrides))
    (budget,) = [c for c in run.trainer.callbacks if isinstance(c, MemoryBudget)]
    measured = budget.plan.measurements
    assert len(measured) == 2 and budget.plan.chosen.knobs in {m.knobs for m in measured if m.outcome == "measured"}
    fit(run)
    assert run.trainer.logger.experiment.hparams["memopt/plan_measure_seconds"] == round(budget.plan.measure_seconds, 3)


def test_given_knobs_are_not_planned(compose_train):
    run = build_run(compose_train(*NORMALS, "memopt=planned"))
    (budget,) = [c for c in run.trainer.callbacks if isinstance(c, MemoryBudget)]
    assert budget.plan is None and budget.knobs is not None


def test_the_one_knobs_override_memopt_plan_prints_trains_with_those_knobs(compose_train):
    run = build_run(compose_train(*NORMALS, "knobs={precision:32-true,checkpoint:full,micro_batch_size:1}"))
    (budget,) = [c for c in run.trainer.callbacks if isinstance(c, MemoryBudget)]
    assert budget.plan is None and budget.knobs == Knobs("32-true", checkpoint="full", micro_batch_size=1)
    assert fit(run).steps == 2
    with pytest.raises(ValueError, match="`knobs` apply a plan, and the `memopt` bundle has a MemoryBudget"):
        build_run(compose_train(*NORMALS, "memopt=auto", "knobs={precision:32-true}"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], (1, False, False, "32-true")),
        (["strategy=ddp", "trainer.devices=2", "precision=bf16_mixed"], (2, False, False, "bf16-mixed")),
        (["strategy=ddp", "trainer.devices=[0,1,2]", "trainer.num_nodes=2"], (6, False, False, "32-true")),
        (["strategy=fsdp_memopt", "trainer.devices=2"], (2, True, False, "32-true")),
        (
            ["strategy=fsdp_memopt", "trainer.devices=1", "trainer.strategy.cpu_offload=true"],
            (1, True, True, "32-true"),
        ),
        (["trainer.strategy=fsdp_memopt", "trainer.devices=4"], (4, True, False, "32-true")),
    ],
)
def test_the_run_a_trainer_config_describes(compose_train, overrides, expected):
    target = run_target(compose_train(*TINY_FACE, *overrides).trainer)
    assert (target["devices"], target["fsdp"], target["cpu_offload"], target["precision"]) == expected
    assert target["device"] == torch.device("cpu")


@pytest.mark.slow
@pytest.mark.distributed
def test_under_ddp_memopt_train_plans_once_and_every_rank_applies_rank_0s_plan(tmp_path):
    args = [*NORMALS, "memopt=auto", f"{_BUDGET}=1.0", "strategy=ddp", "trainer.devices=2"]
    result = run_memopt_train(args, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (log,) = tmp_path.glob("logs/train/runs/*/train.log")  # rank 0's
    text = log.read_text()
    assert len(re.findall(r"MemoryBudget:\n", text)) == 1  # one table: rank 0's plan, made in build_run
    assert "planning again" not in text and len(re.findall(r"MemoryBudget: applying", text)) == 1
    assert "samples           8  (all ranks)" in result.stdout  # 2 steps × 2 samples × 2 ranks


@pytest.mark.parametrize(
    ("strategy", "forks"),
    [("ddp_fork", True), ("ddp_notebook", True), ("ddp", False), ("auto", False), ("ddp_spawn", False)],
)
def test_a_strategy_that_forks_its_ranks_is_known(strategy, forks):
    from lightning_memopt.cli.plan_ahead import _starts_by_fork

    assert _starts_by_fork(strategy) is forks


def test_plan_ahead_leaves_a_forking_gpu_run_to_setup(monkeypatch):
    # querying the GPU before the fork would start CUDA in the parent, which a forked rank cannot use
    from omegaconf import OmegaConf

    from lightning_memopt.cli import plan_ahead as module

    monkeypatch.setattr(module, "run_target", lambda trainer: {"device": torch.device("cuda", 0)})
    budget = MemoryBudget()
    monkeypatch.setattr(budget, "plan_ahead", lambda *args, **kwargs: pytest.fail("planned before the fork"))
    module.plan_ahead([budget], None, None, OmegaConf.create({"strategy": "ddp_fork"}))
    monkeypatch.setattr(module, "training_batch", lambda datamodule: torch.zeros(1))
    planned = []
    monkeypatch.setattr(budget, "plan_ahead", lambda *args, **kwargs: planned.append(kwargs))
    module.plan_ahead([budget], None, None, OmegaConf.create({"strategy": "ddp"}))
    assert planned == [{"device": torch.device("cuda", 0)}]


def test_setup_plans_for_the_strategy_root_device_not_the_module_still_on_the_cpu():
    from types import SimpleNamespace

    from lightning_memopt.callbacks.memory_budget_plan import PlanTarget

    strategy = SimpleNamespace(root_device=torch.device("cuda", 1))
    trainer = SimpleNamespace(strategy=strategy, world_size=1, precision="32-true")
    module = torch.nn.Linear(2, 2)  # in `setup` the module is still on the CPU
    assert PlanTarget.of(trainer, module).device == torch.device("cuda", 1)
