"""plan_compiled and weigh_compiled: the largest activation budget predicted to fit, and compiled against eager with
compiling counted against the run's steps (both tried for real on the CPU)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_memopt.planner import Knobs, measure_cpu, plan, plan_compiled
from lightning_memopt.planner.compiled_plan import COMPILE_BUDGETS, weigh_compiled

OPTIONS = {"loss_fn": lambda m, x: m(x).square().mean(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))


def test_the_largest_budget_that_fits_is_chosen_and_a_limit_below_all_says_so():
    batch, loss = torch.randn(64, 64), OPTIONS["loss_fn"]
    roomy = plan_compiled(_net, batch, loss, limit_bytes=2**30)
    assert roomy.budget == 1.0 and roomy.fits and len(roomy.predictions) == 1
    peaks = {p.budget: p.peak_bytes for p in plan_compiled(_net, batch, loss, limit_bytes=1).predictions}
    assert set(peaks) == set(COMPILE_BUDGETS)  # every budget tried before giving up
    between = sorted(peaks.values())[0] + 1
    tight = plan_compiled(_net, batch, loss, limit_bytes=between)
    assert tight.fits and tight.predicted.peak_bytes <= between
    assert all(peaks[budget] > between for budget in COMPILE_BUDGETS if budget > tight.budget)
    nothing = plan_compiled(_net, batch, loss, limit_bytes=1)
    assert not nothing.fits and nothing.predicted.peak_bytes == min(peaks.values())
    assert "over 0.00 MiB" in nothing.describe()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`budgets` is empty"):
        plan_compiled(_net, torch.randn(2, 64), OPTIONS["loss_fn"], 2**20, budgets=())
    with pytest.raises(ValueError, match=r"`compile_budget` must be a number ≥ 0\.0 and ≤ 1\.0, got 1\.5"):
        Knobs(compile_budget=1.5)


def test_compiling_is_counted_against_the_steps_left():
    """Every way is tried on the CPU: the plan's eager choice, the same compiled at the budget that fits, and (where
    the plan checkpoints) compiled with its checkpointing. The one of least compile time plus steps wins; the report
    names it first and gives each way's figures."""
    batch = torch.randn(64, 64)
    result = plan(_net(), batch, measure_cpu(2**30), **OPTIONS)
    for steps in (1, 10**9):
        verdict = weigh_compiled(result, _net(), batch, torch.device("cpu"), steps_left=steps, **OPTIONS)
        assert set(verdict.tried) == {"eager", "compiled"}  # the plan checkpoints nothing here
        assert verdict.tried["eager"][0] == 0.0 and verdict.tried["compiled"][0] >= 0
        totals = {label: compiling + steps * step for label, (compiling, step) in verdict.tried.items()}
        winner = min(totals, key=totals.__getitem__)
        compiled = replace(result.chosen.knobs, checkpoint="none", every_n=1, checkpoint_blocks=(), compile_budget=1.0)
        assert verdict.knobs == (compiled if winner == "compiled" else result.chosen.knobs)
        assert verdict.report.startswith(f"{winner} over {steps} steps: eager (")


def test_a_checkpointing_plan_is_also_tried_compiled_with_its_checkpointing():
    batch = torch.randn(64, 64)
    result = plan(_net(), batch, measure_cpu(2**30), **OPTIONS)
    checkpointed = replace(result.chosen.knobs, checkpoint="full")  # on the three Linear layers (`blocks`)
    result.chosen = replace(result.chosen, knobs=checkpointed)
    verdict = weigh_compiled(result, _net(), batch, torch.device("cpu"), steps_left=10, blocks=[nn.Linear], **OPTIONS)
    assert list(verdict.tried) == ["eager", "compiled", "compiled with the plan's checkpointing"]
    assert "; compiled with the plan's checkpointing (32-true, full, compiled at activation budget 1) " in (
        verdict.report.replace("bf16-mixed", "32-true")
    )
