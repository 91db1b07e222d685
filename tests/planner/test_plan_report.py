"""The plan's report: short by default (the Pareto front, why faster rows lost), every candidate when verbose."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memopt.planner import ResultChangingOption, measure_cpu, plan, with_budget
from lightning_memopt.planner.report import FRONT_ROWS
from tests.helpers import ResidualMLP


def _build(depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), *(ResidualMLP() for _ in range(depth)), nn.Linear(64, 1))


def _plan(**options):
    return plan(
        _build,
        torch.randn(64, 100, 16),
        with_budget(measure_cpu(0), 0.012),
        loss_fn=lambda model, x: model(x).mean(),
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        **options,
    )


def test_the_short_report_is_the_front_around_the_choice_with_one_row_per_label():
    result = _plan()
    front = result.front()
    labels = [candidate.knobs.describe() for candidate in front]
    assert result.chosen in front and len(front) <= FRONT_ROWS and len(set(labels)) == len(labels)
    ordered = sorted(front, key=lambda c: c.cost.total)
    for faster, slower in zip(ordered, ordered[1:], strict=False):  # a front: faster rows need more memory
        assert faster.peak_bytes >= slower.peak_bytes or faster.fits < slower.fits
    for candidate in front:  # the faster rows lost because they do not fit
        if candidate.cost.total < result.chosen.cost.total:
            assert not candidate.fits
    short, verbose = result.table(), result.table(verbose=True)
    assert "over the budget by" in short and "verbose=True lists every one" in short
    assert len(short.splitlines()) < len(verbose.splitlines()) <= len(result.candidates) + len(result.skipped) + 12
    assert all(candidate.knobs.describe() in verbose for candidate in result.candidates)


def test_options_say_what_they_were_measured_against():
    narrower = ResultChangingOption(
        "depth 6 → 3", "a shallower model", ("model.depth=3",), model=lambda: _build(3)
    )  # fmt: skip
    result = _plan(options=[narrower])
    measured = result.options[0]
    assert measured.against == result.chosen.knobs.describe()
    assert measured.saving_bytes == measured.reference_bytes - measured.peak_bytes > 0
    assert f"(each measured against {measured.against}: peak" in result.table()


def test_an_option_that_saves_nothing_is_not_listed():
    same = ResultChangingOption("depth 6 → 6", "the same model", ("model.depth=6",), model=lambda: _build(6))
    result = _plan(options=[same])
    assert result.options[0].saving_bytes <= 0 and "depth 6 → 6" not in result.table()
