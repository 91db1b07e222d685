"""A plan's choice made by measurement: its candidates timed on the device that trains (or recalled from an earlier
run's trials), and the fastest measured that fits chosen.

``MemoryBudget(measure=...)`` and ``memopt-plan measure=true`` choose this way; the fake-mode price only ranks which
candidates to try (:func:`~lightning_memopt.planner.trials.trial_candidates`). In three steps, so that several
ranks can run the same trials: :func:`trials_of` (where the plan is: the candidates and what is remembered of
them), :func:`run_trials` (on every rank, agreeing on each outcome), :func:`choose_measured` (where the plan is).

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from lightning_memopt.planner import measure_cpu, plan
    >>> model, batch = torch.nn.Linear(64, 64), torch.randn(8, 64)
    >>> options = {"loss_fn": lambda m, x: m(x).square().mean(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    >>> result = plan(model, batch, measure_cpu(2**30), every_kind=True, **options)
    >>> memory = TrialMemory(Path(tempfile.mkdtemp()) / "measurements.json")
    >>> report = choose_by_measurement(result, model, batch, "cpu", memory=memory, **options)
    >>> report.splitlines()[-1].startswith("chosen by measurement"), result.measure_seconds > 0
    (True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.profile import LossFn, OptimizerSource
from lightning_memopt.planner.remembered import TrialMemory, trial_key
from lightning_memopt.planner.report import Candidate, Plan
from lightning_memopt.planner.trials import Measurement, fastest_measured, measure_candidates, trial_candidates


@dataclass
class Trials:
    """The candidates to try, in order, and the step seconds and peaks remembered of some of them, under ``key``."""

    key: str
    candidates: list[Candidate]
    limit_bytes: int
    remembered: Mapping[Any, tuple[float | None, int | None]] = field(default_factory=dict)


def trials_of(
    plan: Plan,
    model: nn.Module,
    batch: Any,
    device: torch.device,
    *,
    most: int = 6,
    refresh: bool = False,
    devices: int = 1,
    memory: TrialMemory | None = None,
) -> Trials:
    """``plan``'s candidates of each kind to try (at most ``most``), with what ``memory`` remembers of them for this
    model, batch and device (nothing if ``refresh``)."""
    memory = memory if memory is not None else TrialMemory()
    key = trial_key(model, batch, device, devices)
    candidates = trial_candidates(plan.candidates, most)
    remembered = {} if refresh else memory.recall(key, [c.knobs for c in candidates])
    return Trials(key, candidates, plan.limit_bytes, remembered)


def run_trials(
    trials: Trials,
    model: nn.Module,
    batch: Any,
    device: torch.device,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    blocks: Any = "auto",
    steps: int = 3,
    seconds: float = 60.0,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> list[Measurement]:
    """:func:`~lightning_memopt.planner.trials.measure_candidates` of ``trials`` (``agree``: every rank's values
    reduced to their maxima, for trials run on several ranks)."""
    return measure_candidates(
        model, batch, trials.candidates, trials.limit_bytes, loss_fn=loss_fn, optimizer=optimizer, device=device,
        blocks=blocks, steps=steps, seconds=seconds, remembered=trials.remembered, agree=agree,
    )  # fmt: skip


def choose_measured(
    plan: Plan, trials: Trials, measurements: list[Measurement], seconds: float, memory: TrialMemory | None = None
) -> str:
    """Set ``plan.measurements``, ``plan.measure_seconds`` and ``plan.chosen`` (the fastest measured that fits, else
    the candidate of the least predicted peak), remember the new trials, and return the report."""
    priced = plan.chosen
    (memory if memory is not None else TrialMemory()).remember(
        trials.key, [m for m in measurements if not m.remembered]
    )
    plan.measurements, plan.measure_seconds = measurements, seconds
    fastest = fastest_measured(measurements, plan.limit_bytes)
    if fastest is not None:
        plan.chosen = next(c for c in trials.candidates if c.knobs == fastest.knobs)
    else:  # AdaptiveAccumulation (MemoryBudget always applies it) halves its micro-batches should this run out
        unsharded = [c for c in plan.candidates if c.fits and not c.knobs.sharding.active]
        plan.chosen = min(unsharded, key=lambda c: (c.peak_bytes, c.cost.total))
    return plan.measured_report(priced)


NOT_TRIALLED = "not measured: only sharded or offloaded candidates fit, and a trial cannot shard in this process"


def choose_by_measurement(
    plan: Plan,
    model: nn.Module,
    batch: Any,
    device: torch.device | str,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    blocks: Any = "auto",
    most: int = 6,
    steps: int = 3,
    seconds: float = 60.0,
    refresh: bool = False,
    memory: TrialMemory | None = None,
) -> str:
    """The three steps on one device: ``plan``'s candidates of each kind timed on ``device`` (or recalled), and the
    fastest measured that fits chosen. Returns the report. ``plan.chosen`` must not be ``None``."""
    device = torch.device(device)
    started = time.perf_counter()
    trials = trials_of(plan, model, batch, device, most=most, refresh=refresh, memory=memory)
    if not trials.candidates:
        return NOT_TRIALLED
    measurements = run_trials(
        trials, model, batch, device, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, steps=steps,
        seconds=seconds,
    )  # fmt: skip
    return choose_measured(plan, trials, measurements, time.perf_counter() - started, memory)
