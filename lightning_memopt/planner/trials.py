"""Plans measured on the device that trains: the candidates predicted to fit, each timed for real, the fastest kept.

The fake-mode plan prices a step from counted work and a catalogue of rates; a device's real costs can be far from
them (on an H200, selective recomputation cost 1.93× a step where it was priced near full's). Here the candidates
the plan predicts to fit are run on the live device: a copy of the model with the knobs applied, the run's own batch,
its ``training_step``, backward and optimizer step, two steps with the peak watched (on CUDA the allocator's peak,
elsewhere the :class:`~lightning_memopt.memory.MemoryTracker`'s) and ``steps`` more timed, the fastest kept.
Nothing of the run changes: the copy is thrown away and every random number generator is set back. An
out-of-memory error ends that trial alone; the candidates predicted to need as much or more are not tried.

Example::

    >>> import torch
    >>> from lightning_memopt.planner import measure_cpu, plan
    >>> model, batch = torch.nn.Linear(64, 64), torch.randn(8, 64)
    >>> options = {"loss_fn": lambda m, x: m(x).square().mean(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    >>> result = plan(model, batch, measure_cpu(2**30), **options)
    >>> found = measure_candidates(model, batch, trial_candidates(result.candidates, 2), result.limit_bytes, **options)
    >>> {m.outcome for m in found}
    {'measured'}
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.batch_slicing import batch_size, slice_batch
from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory.compiled import uncompiled_copy
from lightning_memopt.memory.profile import LossFn, OptimizerSource
from lightning_memopt.memory.step_parts import (
    build_optimizer,
    quiet_logger,
    quiet_logging,
    training_step_fn,
)
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.models.structure import set_attention
from lightning_memopt.planner.report import Candidate
from lightning_memopt.private_api import activation_memory_budget, attached_trainer, disable_current_modes, tree_map
from lightning_memopt.random_generators import random_state_kept

MEASURED, OUT_OF_MEMORY, OVER_BUDGET = "measured", "out of memory", "over the budget"
_HALF = {"bf16": torch.bfloat16, "16": torch.float16}


@dataclass(frozen=True)
class Measurement:
    """One candidate tried on the device: what the plan predicted, what was measured, and how the trial ended
    (:data:`MEASURED`, :data:`OUT_OF_MEMORY`, :data:`OVER_BUDGET` or ``"untried: <why>"``)."""

    knobs: Any
    predicted_seconds: float
    predicted_peak_bytes: int
    measured_seconds: float | None = None
    measured_peak_bytes: int | None = None
    outcome: str = "untried"
    remembered: bool = False  # recalled from an earlier run's trial (planner.remembered), not run now

    @classmethod
    def of(
        cls, candidate: Candidate, seconds: float | None, peak: int | None, limit_bytes: int, remembered: bool = False
    ) -> Measurement:
        """``candidate`` tried: a step of ``seconds`` and a ``peak`` (``None``: it ran out of memory)."""
        outcome = OUT_OF_MEMORY if peak is None else MEASURED if peak <= limit_bytes else OVER_BUDGET
        return cls(candidate.knobs, candidate.cost.total, candidate.peak_bytes, seconds, peak, outcome, remembered)

    def fits(self, limit_bytes: int) -> bool:
        return (
            self.outcome == MEASURED
            and self.measured_peak_bytes is not None
            and self.measured_peak_bytes <= limit_bytes
        )


def trial_candidates(candidates: list[Candidate], most: int) -> list[Candidate]:
    """The candidates to measure, at most ``most``, by predicted time: of those predicted to fit (unsharded, as the
    live strategy runs them), the fastest, then the fastest of each kind from the coarsest, where a wrong price
    misleads most, to the finest: each precision, with and without micro-batches, each attention kernel, and each
    set of checkpointing modes used (none, full, selective, offload or a per-block mix); then the next fastest.

    Example::

        >>> trial_candidates([], 6)
        []
    """

    def price(candidate: Candidate) -> tuple[float, int]:
        return candidate.cost.total, candidate.peak_bytes

    fitting = sorted((c for c in candidates if c.fits and not c.knobs.sharding.active), key=price)
    picked: dict[Any, Candidate] = {}
    for kind in _KINDS:  # the first of each is the fastest of its kind
        fastest_of_kind: dict[Any, Candidate] = {}
        for candidate in fitting:
            fastest_of_kind.setdefault(kind(candidate.knobs), candidate)
        for candidate in fastest_of_kind.values():
            picked.setdefault(candidate.knobs, candidate)
    for candidate in fitting:
        picked.setdefault(candidate.knobs, candidate)
    return sorted(list(picked.values())[: max(most, 0)], key=price)


def _modes(knobs: Any) -> frozenset[str]:
    if knobs.checkpoint == "per_block":
        return frozenset(mode for _, mode in knobs.checkpoint_blocks)
    return frozenset([knobs.checkpoint]) - {"none"}


_KINDS: tuple[Callable[[Any], Any], ...] = (  # from the coarsest to the finest
    lambda knobs: knobs.precision,
    lambda knobs: (knobs.precision, knobs.micro_batch_size is not None),
    lambda knobs: (knobs.precision, knobs.micro_batch_size is not None, knobs.attn_impl),
    lambda knobs: (knobs.precision, knobs.micro_batch_size is not None, knobs.attn_impl, _modes(knobs)),
)


def measure_candidates(
    model: nn.Module,
    batch: Any,
    candidates: list[Candidate],
    limit_bytes: int,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    device: torch.device | str | None = None,
    blocks: Any = "auto",
    steps: int = 3,
    seconds: float = 60.0,
    remembered: Mapping[Any, tuple[float | None, int | None]] | None = None,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> list[Measurement]:
    """Each of ``candidates`` run on ``device`` (default: where ``model`` is): its peak over two steps and its
    fastest of ``steps`` more. The first is always tried; one expected to end past ``seconds`` of measuring (its
    length: the trials so far, scaled by its predicted step time) is reported untried, and so are those predicted
    to need as much memory as one that ran out, or more than ``limit_bytes``
    once their prediction is raised by the worst miss measured so far (measured peak over predicted). Candidates
    whose knobs ``remembered`` maps to an earlier trial's seconds and peak are not run again. Those measured within
    10 % of the fastest that fits (at most 3) run once more, time allowing, each keeping its faster step: a run-off.
    ``model`` and every random number generator are left as they were.

    On several ranks, each runs the same candidates and ``agree`` takes each rank's values to their maxima (an
    all-reduce): whether time is up, and each trial's ran-out-of-memory flag, seconds and peak — a candidate that
    ran out on one rank ran out on all, its time is the slowest rank's, and every rank decides alike."""
    remembered = remembered or {}
    device = torch.device(device) if device is not None else next(model.parameters(), torch.empty(0)).device
    started = time.perf_counter()
    found: list[Measurement] = []
    out_of_memory_at: int | None = None  # the smallest predicted peak that ran out of memory
    miss = 1.0  # the most a measured peak exceeded its prediction, as a ratio
    trial_pace = _TrialPace()

    def tried(candidate: Candidate) -> tuple[int | None, float]:
        """``candidate`` run on the device, every rank's outcome agreed: its peak (``None``: out of memory), step."""
        trial_started = time.perf_counter()
        trial = Trial(model, batch, candidate.knobs, device, loss_fn, optimizer, blocks)
        peak: int | None = None
        step_seconds = 0.0
        try:
            with random_state_kept():
                peak, step_seconds = trial.run(steps)
        except torch.OutOfMemoryError:
            pass  # released below, once the error (and the tensors its frames hold) is gone
        trial.release()
        trial_pace.ran(candidate, time.perf_counter() - trial_started)
        ran_out, step_seconds, highest = _agreed(agree, [float(peak is None), step_seconds, float(peak or 0)])
        return None if ran_out > 0 else int(highest), step_seconds

    def time_is_up(candidate: Candidate) -> bool:
        ends = time.perf_counter() - started + trial_pace.expected(candidate)
        return _agreed(agree, [float(bool(found) and ends > seconds)])[0] > 0

    for candidate in candidates:
        predicted = Measurement(candidate.knobs, candidate.cost.total, candidate.peak_bytes)
        if candidate.knobs in remembered:
            recalled_seconds, recalled_peak = remembered[candidate.knobs]
            found.append(Measurement.of(candidate, recalled_seconds, recalled_peak, limit_bytes, remembered=True))
        elif time_is_up(candidate):
            found.append(_untried(predicted, f"untried: it would end past {seconds:g} s of measuring"))
        elif out_of_memory_at is not None and candidate.peak_bytes >= out_of_memory_at:
            found.append(_untried(predicted, "untried: predicted to need as much as one that ran out of memory"))
        elif candidate.peak_bytes * miss > limit_bytes:
            found.append(_untried(predicted, f"untried: over the limit by the measured miss (×{miss:.3f})"))
        else:
            peak, step_seconds = tried(candidate)
            found.append(Measurement.of(candidate, None if peak is None else step_seconds, peak, limit_bytes))
        latest = found[-1]
        if latest.outcome == OUT_OF_MEMORY:
            out_of_memory_at = min(candidate.peak_bytes, out_of_memory_at or candidate.peak_bytes)
        elif latest.measured_peak_bytes is not None:
            miss = max(miss, latest.measured_peak_bytes / max(candidate.peak_bytes, 1))
    # a run-off: those measured within RUN_OFF of the fastest that fits run again, in the reverse order, each keeping
    # its faster time (one trial's few steps can be a tenth off on a shared machine; a drift in its speed cancels)
    by_knobs = {candidate.knobs: candidate for candidate in candidates}
    for index in reversed(_close_to_the_fastest(found, limit_bytes)):
        candidate, first = by_knobs[found[index].knobs], found[index]
        if time_is_up(candidate):
            break
        peak, step_seconds = tried(candidate)
        if peak is not None:
            fastest = min(step_seconds, first.measured_seconds or step_seconds)
            found[index] = Measurement.of(candidate, fastest, max(peak, first.measured_peak_bytes or 0), limit_bytes)
    return found


RUN_OFF = 1.10  # measured within 10 % of the fastest that fits: run again, to tell them apart
RUN_OFF_MOST = 3


def _close_to_the_fastest(found: list[Measurement], limit_bytes: int) -> list[int]:
    """The positions in ``found`` of the (at most :data:`RUN_OFF_MOST`) trials run now that fit and are within
    :data:`RUN_OFF` of the fastest, in their order; none where the fastest has no rival."""
    fitting = sorted(
        (i for i, m in enumerate(found) if m.fits(limit_bytes) and not m.remembered),
        key=lambda i: found[i].measured_seconds,
    )
    if not fitting:
        return []
    fastest = found[fitting[0]].measured_seconds
    close = sorted([i for i in fitting if found[i].measured_seconds <= fastest * RUN_OFF][:RUN_OFF_MOST])
    return close if len(close) > 1 else []


class _TrialPace:
    """How long a trial takes: the trials run so far, in seconds per second of predicted step time (a trial's length
    scales with its step's: micro-batches, recomputation)."""

    def __init__(self) -> None:
        self.seconds, self.priced = 0.0, 0.0

    def ran(self, candidate: Candidate, seconds: float) -> None:
        self.seconds += seconds
        self.priced += candidate.cost.total

    def expected(self, candidate: Candidate) -> float:
        return self.seconds / self.priced * candidate.cost.total if self.priced > 0 else 0.0


def _agreed(agree: Callable[[list[float]], list[float]] | None, values: list[float]) -> list[float]:
    return values if agree is None else agree(values)


def fastest_measured(measurements: list[Measurement], limit_bytes: int) -> Measurement | None:
    """The measured candidate of the least step time whose measured peak fits ``limit_bytes``."""
    fitting = [m for m in measurements if m.fits(limit_bytes)]
    return min(fitting, key=lambda m: m.measured_seconds, default=None)


def _untried(predicted: Measurement, outcome: str) -> Measurement:
    return Measurement(predicted.knobs, predicted.predicted_seconds, predicted.predicted_peak_bytes, outcome=outcome)


class Trial:
    """A copy of the model on the device with one candidate's knobs applied, and its optimizer."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        knobs: Any,
        device: torch.device,
        loss_fn: LossFn | None,
        optimizer: OptimizerSource | None,
        blocks: Any,
    ) -> None:
        self.knobs, self.device = knobs, device
        trainer = attached_trainer(model)
        memo = {} if trainer is None else {id(trainer): None}  # no trial step reaches the run's trainer or loggers
        with disable_current_modes():  # a copy of what the device holds already, not the step's allocations
            self.model: nn.Module | None = uncompiled_copy(model, memo).to(device)
        set_attention(self.model, knobs.attn_impl)
        self.compile_budget: float | None = knobs.compile_budget
        self.compile_seconds = 0.0  # a compiled candidate's first step, less its fastest: compiling
        policy = knobs.checkpoint_policy(blocks)
        if policy is not None:
            with quiet_logger("lightning_memopt.checkpointing"):
                apply_activation_checkpointing(self.model, policy)
        self.step = training_step_fn(self.model, loss_fn)
        if self.compile_budget is not None:  # what CompiledStep compiles: the training step, with all it calls
            self.step = torch.compile(self.step)
        self.optimizer: Any = build_optimizer(self.model, optimizer, None)
        moved = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        self.pieces = list(micro_batches(moved, knobs.micro_batch_size))
        half = _HALF.get(knobs.precision.split("-")[0])
        self.autocast = (device.type, half, knobs.precision.endswith("-mixed"))
        scaled = knobs.precision == "16-mixed" and device.type == "cuda"
        self.scaler = torch.amp.GradScaler(device.type) if scaled else None

    def run(self, steps: int) -> tuple[int, float]:
        """The peak bytes over two steps, and the fastest of ``steps`` more in seconds. A compiled candidate compiles
        in a step before those, under its budget; off CUDA its peak is not measured (0): the tracker's dispatch mode
        would run it uncompiled."""
        self.model.train()
        on_cuda = self.device.type == "cuda"
        first = 0.0
        if self.compile_budget is not None:
            started = time.perf_counter()
            with activation_memory_budget(self.compile_budget):
                self._step()
            first = time.perf_counter() - started
        if self.compile_budget is not None and not on_cuda:
            peak = 0
            for _ in range(2):
                self._step()
        elif on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            for _ in range(2):
                self._step()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            tracker = MemoryTracker(round_to=512)
            tracker.track_module(self.model)
            tracker.track_optimizer(self.optimizer)
            with tracker:
                for _ in range(2):
                    self._step()
            tracker.remove_hooks()
            peak = tracker.peak.total_bytes
        fastest = float("inf")
        for _ in range(steps):
            if on_cuda:
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self._step()
            if on_cuda:
                torch.cuda.synchronize(self.device)
            fastest = min(fastest, time.perf_counter() - start)
        self.compile_seconds = max(0.0, first - fastest) if first else 0.0
        return peak, fastest

    def _step(self) -> None:
        device_type, dtype, enabled = self.autocast
        for piece, share in self.pieces:
            with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False), quiet_logging():
                loss = self.step(piece) * share
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            del loss
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def release(self) -> None:
        """Let go of the copy, its optimizer state and the batch: the device's memory back for the next trial."""
        self.model = self.optimizer = self.step = None
        self.pieces = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def micro_batches(batch: Any, size: int | None) -> Iterator[tuple[Any, float]]:
    """The batch's micro-batches of ``size`` samples (the whole batch for ``None``), each with its share of it."""
    total = batch_size(batch)
    if size is None or size >= total:
        yield batch, 1.0
        return
    for start in range(0, total, size):
        stop = min(start + size, total)
        yield slice_batch(batch, start, stop), (stop - start) / total
