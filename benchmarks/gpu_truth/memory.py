"""gpu_truth.py's memory rows: the fake-mode prediction against the device's peak, and MemoryBudget's plan run.

Predictions run in worker processes (fake mode uses the CPU only) while the device measures the real
steps; every prediction is counted at 512-byte granularity, as the CUDA caching allocator rounds.

Example::

    >>> [_variant(*variant) for variant in VARIANTS[:2]]
    ['32-true, checkpointing none', '32-true, checkpointing preset']
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch
from torch import nn

from lightning_memopt.callbacks import AdaptiveAccumulation, MemoryBudget
from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import profile_step
from lightning_memopt.memory.step_parts import lightning_optimizer, quiet_logging, training_step_fn
from lightning_memopt.memory.workspace import LibraryWorkspace
from lightning_memopt.planner.hardware import cuda_hardware
from lightning_memopt.planner.space import DEFAULT_SAFETY_MARGIN
from lightning_memopt.private_api import cuda_memory_snapshot, record_cuda_memory_history
from lightning_memopt.vocabulary import GIB

from .cases import SUITES, Case, repeated
from .device import Peak, TruthDevice
from .peak_trace import describe, live_at_peak
from .rows import row

# (precision, checkpointing policy): fp32 and bf16-mixed, without and with the preset's blocks checkpointed
VARIANTS = (("32-true", None), ("32-true", "preset"), ("bf16-mixed", None), ("bf16-mixed", "preset"))
PREDICTION_TOLERANCE = 0.05  # a prediction more than 5% off the allocator's peak fails the run
TRACE_ENTRIES = 2_000_000  # the allocator's history kept to explain a missed prediction
ACTIVATION_CUT = 0.5  # the planner's device: the model states and half the rest of the unchecked fp32 peak


def _prepare(policy: str | None) -> Any:
    return None if policy is None else lambda module: apply_activation_checkpointing(module, policy)


def predicted_peak(
    suite: str,
    index: int,
    precision: str,
    policy: str | None,
    device_type: str = "cuda",
    workspace: LibraryWorkspace | None = None,
) -> int:
    """Fake-mode peak of case ``index`` of ``suite``'s predictions (run in a worker: cases are found by index),
    following ``device_type``'s autocast lists, with ``workspace``'s library workspaces."""
    torch.set_num_threads(1)
    case = SUITES[suite].predictions[index]
    profile = profile_step(
        case.build,
        case.batch(),
        mode="fake",
        precision=precision,
        prepare_model=_prepare(policy),
        round_to=512,
        device_type=device_type,
        workspace=workspace,
    )
    return profile.peak_bytes


def measured_peak(
    device: TruthDevice, case: Case, precision: str, policy: str | None, cap: int | None = None
) -> tuple[Peak, int]:
    """Two training steps on ``device``, as ``profile_step`` runs them: the allocator's peaks on CUDA, the
    tracker's on the CPU (no tracker on CUDA: it would slow the steps); and the bytes of the model states
    (parameters, as many for their gradients, optimizer state). With ``cap``, on a device of that many bytes
    (an out-of-memory error past it)."""
    device.release()
    torch.manual_seed(0)
    with device.device:
        module = case.build()
    if policy is not None:
        apply_activation_checkpointing(module, policy)
    module.train()
    step, optimizer = training_step_fn(module, None), lightning_optimizer(module)
    autocast = torch.autocast(device.device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed",
                              cache_enabled=False)  # fmt: skip
    measuring = device.peaks(include=(module,)) if cap is None else device.capped(cap, include=(module,))
    with measuring as peak:
        batch = device.to_device(case.batch())  # counted, as profile_step counts the batch
        for _ in range(2):  # the second step has the optimizer state
            with autocast, quiet_logging():
                loss = step(batch)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del batch
    states = sum(2 * p.nbytes for p in module.parameters()) + sum(
        value.nbytes for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )
    del module, optimizer
    device.release()
    return peak, states


def peak_breakdown(device: TruthDevice, case: Case, precision: str, policy: str | None) -> str:
    """Where a CUDA step's real peak came from: :func:`measured_peak` run again with the allocator's history on,
    the blocks live at its peak grouped by the line of code that allocated them (for a prediction that missed)."""
    record_cuda_memory_history(True, max_entries=TRACE_ENTRIES, stacks="python")
    try:
        measured_peak(device, case, precision, policy)
        snapshot = cuda_memory_snapshot(device.device)
    finally:
        record_cuda_memory_history(False)
    index = device.device.index or 0
    truncated = len(snapshot["device_traces"][index]) >= TRACE_ENTRIES  # the first events were dropped
    peak, groups = live_at_peak(snapshot, index, top=6)
    traced = f"{peak / 2**20:.1f} MiB traced{', the trace truncated' if truncated else ''}"
    return f"live at the real peak ({traced}): {describe(groups)}"


def _variant(precision: str, policy: str | None) -> str:
    return f"{precision}, checkpointing {policy or 'none'}"


def prediction_rows(device: TruthDevice, suite: str, workers: int) -> tuple[list[dict], dict[str, tuple[int, int]]]:
    """One row per case and variant, and each case's measured unchecked fp32 peak and model states (for the
    planner rows)."""
    cases = SUITES[suite].predictions
    workspace = cuda_hardware(device.device).workspace if device.is_cuda else None
    context = multiprocessing.get_context("spawn")  # never fork a process that has started CUDA
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures: dict[tuple[int, str, str | None], Future[int]] = {
            (index, precision, policy): pool.submit(
                predicted_peak, suite, index, precision, policy, device.device.type, workspace
            )
            for index in range(len(cases))
            for precision, policy in VARIANTS
        }
        measured = {
            (index, precision, policy): measured_peak(device, case, precision, policy)
            for index, case in enumerate(cases)
            for precision, policy in VARIANTS
        }
        rows = []
        for (index, precision, policy), future in futures.items():
            (peak, _), predicted = measured[index, precision, policy], future.result()
            deviation = predicted / peak.allocated - 1
            passed = abs(deviation) <= PREDICTION_TOLERANCE
            missed = not passed and device.is_cuda
            note = peak_breakdown(device, cases[index], precision, policy) if missed else ""
            rows.append(
                row(
                    "prediction",
                    cases[index].name,
                    _variant(precision, policy),
                    predicted=predicted,
                    peak=peak,
                    deviation=deviation,
                    passed=passed,
                    note=note,
                )
            )
    unchecked = {case.name: (measured[index, "32-true", None][0].allocated, measured[index, "32-true", None][1])
                 for index, case in enumerate(cases)}  # fmt: skip
    return rows, unchecked


MARGIN_VARIANTS = (("32-true", None), ("bf16-mixed", "preset"))  # the smallest device: unchecked fp32, checked bf16


def smallest_cap(device: TruthDevice, case: Case, precision: str, policy: str | None, low: int, high: int) -> int:
    """The least memory (bytes) of a device on which two steps of ``case`` run, to 1/32 of ``high − low``:
    bisected between ``low`` (the allocated peak: never less) and ``high`` (doubled until it runs, at most the
    device's memory beside its context: past it, a ``RuntimeError``)."""
    usable = device.total_bytes - device.context_bytes if device.is_cuda else None
    high = high if usable is None else min(high, usable)
    while not _runs_within(device, case, precision, policy, high):
        if usable is not None and high >= usable:
            raise RuntimeError(f"{case.name} does not run within this device's {usable / 2**20:.0f} MiB")
        low, high = high, 2 * high if usable is None else min(2 * high, usable)
    for _ in range(5):
        middle = (low + high) // 2
        low, high = (low, middle) if _runs_within(device, case, precision, policy, middle) else (middle, high)
    return high


def _runs_within(device: TruthDevice, case: Case, precision: str, policy: str | None, cap: int) -> bool:
    try:
        measured_peak(device, case, precision, policy, cap=cap)
    except torch.OutOfMemoryError:
        device.release()
        return False
    return True


def smallest_device_rows(device: TruthDevice, suite: str, predictions: list[dict]) -> list[dict]:
    """For the margin cases, the least device memory the step runs on, and the safety margin its prediction
    needs: a plan keeps its prediction P within (1 − m) of the device's T bytes, whose CUDA context C leaves
    T − C to the allocator, so the step runs when m ≥ 1 − (P / S)(1 − C / T), S the least memory it runs on
    (``ratio``; T and C this device's)."""
    found = {(r["case"], r["variant"]): r for r in predictions}
    rows = []
    for case in SUITES[suite].margins:
        for precision, policy in MARGIN_VARIANTS:
            measured = found[case.name, _variant(precision, policy)]
            predicted, allocated = measured["predicted_mib"] * 2**20, measured["allocated_mib"] * 2**20
            reserved = measured["reserved_mib"] * 2**20
            high = int(reserved if not math.isnan(reserved) else 1.25 * allocated) + 2**20
            least = smallest_cap(device, case, precision, policy, int(allocated), high)
            needed = max(0.0, 1 - predicted / least * (1 - device.context_bytes / device.total_bytes))
            rows.append(
                row(
                    "smallest device",
                    case.name,
                    _variant(precision, policy),
                    predicted=int(predicted),
                    ratio=needed,
                    note=f"runs on {least / 2**20:.0f} MiB (allocated {allocated / 2**20:.0f}, reserved "
                    f"{reserved / 2**20:.0f} with the whole device); ratio: the safety margin it needs",
                )
            )
    return rows


def margin_row(smallest: list[dict], predictions: list[dict] = ()) -> dict:
    """The least ``safety_margin`` covering every smallest-device row whose prediction holds (the formula:
    :func:`smallest_device_rows`), and a check that the planner's default covers it.

    A row whose prediction row failed (more than 5 % off) is left out of the check and named: the margin covers
    what the allocator holds beyond a right prediction; a wrong prediction fails its own row until it is fixed.
    """
    missed = {(r["case"], r["variant"]) for r in predictions if r["passed"] == "no"}
    covered = [r for r in smallest if (r["case"], r["variant"]) not in missed]
    left = [r for r in smallest if (r["case"], r["variant"]) in missed]
    needed = max((r["ratio"] for r in covered), default=0.0)
    note = f"m ≥ 1 − (P / S)(1 − C / T) over the rows; the planner's default {DEFAULT_SAFETY_MARGIN:g}"
    if left:
        note += "; left out (prediction more than 5 % off): " + ", ".join(
            f"{r['case']} {r['variant']} needs {float(r['ratio']):.3f}" for r in left
        )
    return row(
        "calibration",
        "safety_margin",
        "the least covering every smallest-device row whose prediction holds",
        ratio=needed,
        passed=needed <= DEFAULT_SAFETY_MARGIN,
        note=note,
    )


def _accumulation(budget: MemoryBudget) -> AdaptiveAccumulation:
    return next(callback for callback in budget.applied if isinstance(callback, AdaptiveAccumulation))


def planned_row(device: TruthDevice, case: Case, unchecked: tuple[int, int]) -> dict:
    """MemoryBudget plans ``case`` for a device cut below its unchecked peak (:data:`ACTIVATION_CUT`); the fit
    runs on the device capped there."""
    peak_bytes, states = unchecked
    cap = int(states + ACTIVATION_CUT * (peak_bytes - states))
    device.release()
    torch.manual_seed(0)
    module: nn.Module = case.build()
    budget = MemoryBudget(budget=cap / GIB)
    trainer = device.trainer(2, [budget])
    failure = ""
    with device.capped(cap, include=(module,)) as peak:
        try:
            trainer.fit(module, repeated(case.batch(), 2))
        except torch.OutOfMemoryError as error:
            failure = f"; the fit ran out of memory: {str(error).splitlines()[0]}"
    chosen = budget.plan.chosen  # planned in setup, before the strategy moves the model: an OOM comes later
    recoveries = _accumulation(budget).sizer.oom_recoveries
    deviation = chosen.peak_bytes / peak.allocated - 1
    return row(
        "planner",
        case.name,
        chosen.knobs.describe(),
        predicted=chosen.peak_bytes,
        peak=peak,
        deviation=deviation,
        passed=not failure and recoveries == 0 and peak.held <= cap and abs(deviation) <= PREDICTION_TOLERANCE,
        note=f"device capped at {cap / 2**20:.0f} MiB; {recoveries} OOM recovered{failure}",
    )
