"""A plan's choice made by measurement: its candidates timed on the device that trains (or recalled from an earlier
run's trials), and the fastest measured that fits chosen.

``MemoryBudget(measure=...)`` and ``memopt-plan measure=true`` choose this way; the fake-mode price only ranks which
candidates to try (:func:`~lightning_memopt.planner.trials.trial_candidates`).

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
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.profile import LossFn, OptimizerSource
from lightning_memopt.planner.remembered import TrialMemory, trial_key
from lightning_memopt.planner.report import Plan
from lightning_memopt.planner.trials import fastest_measured, measure_candidates, trial_candidates


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
    devices: int = 1,
    memory: TrialMemory | None = None,
) -> str:
    """Time ``plan``'s candidates of each kind on ``device`` (at most ``most``; those ``memory`` remembers for this
    model, batch and device are recalled unless ``refresh``) and set ``plan.measurements``, ``plan.measure_seconds``
    and ``plan.chosen``: the fastest measured that fits, else the candidate of the least predicted peak. Returns the
    report (:meth:`~lightning_memopt.planner.report.Plan.measured_report`). ``plan.chosen`` must not be ``None``."""
    device = torch.device(device)
    priced = plan.chosen
    candidates = trial_candidates(plan.candidates, most)
    if not candidates:
        return "not measured: only sharded or offloaded candidates fit, and a trial cannot shard in this process"
    started = time.perf_counter()
    memory = memory if memory is not None else TrialMemory()
    key = trial_key(model, batch, device, devices)
    remembered = {} if refresh else memory.recall(key, [c.knobs for c in candidates])
    plan.measurements = measure_candidates(
        model, batch, candidates, plan.limit_bytes, loss_fn=loss_fn, optimizer=optimizer, device=device,
        blocks=blocks, steps=steps, seconds=seconds, remembered=remembered,
    )  # fmt: skip
    memory.remember(key, [m for m in plan.measurements if not m.remembered])
    plan.measure_seconds = time.perf_counter() - started
    fastest = fastest_measured(plan.measurements, plan.limit_bytes)
    if fastest is not None:
        plan.chosen = next(c for c in candidates if c.knobs == fastest.knobs)
    else:  # AdaptiveAccumulation (MemoryBudget always applies it) halves its micro-batches should this run out
        unsharded = [c for c in plan.candidates if c.fits and not c.knobs.sharding.active]
        plan.chosen = min(unsharded, key=lambda c: (c.peak_bytes, c.cost.total))
    return plan.measured_report(priced)
