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


def _follows_the_rule(verdict, steps: int, eager_knobs: Knobs) -> bool:
    compiled_total = verdict.compile_seconds + steps * verdict.compiled_seconds
    wins = compiled_total < steps * verdict.eager_seconds
    compiled = replace(eager_knobs, checkpoint="none", every_n=1, checkpoint_blocks=(), compile_budget=1.0)
    return verdict.knobs == (compiled if wins else eager_knobs)


def test_compiling_is_counted_against_the_steps_left():
    """Both are tried on the CPU: compiled wins only where its compile time and steps beat the eager steps. One step
    repays no compile that takes longer than the eager step; the report says which won and why."""
    batch = torch.randn(64, 64)
    result = plan(_net(), batch, measure_cpu(2**30), **OPTIONS)
    for steps in (1, 10**9):
        verdict = weigh_compiled(result, _net(), batch, torch.device("cpu"), steps_left=steps, **OPTIONS)
        assert verdict.compile_seconds >= 0 and verdict.compiled_seconds > 0 and verdict.eager_seconds > 0
        assert _follows_the_rule(verdict, steps, result.chosen.knobs), verdict
        winner = "compiled" if verdict.knobs.compile_budget is not None else "eager"
        assert verdict.report.startswith(f"{winner} over {steps} steps: compiled ")
    if verdict.compile_seconds > verdict.eager_seconds:
        short = weigh_compiled(result, _net(), batch, torch.device("cpu"), steps_left=1, **OPTIONS)
        assert short.knobs == result.chosen.knobs or short.compile_seconds < short.eager_seconds
