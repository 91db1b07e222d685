"""gpu_truth.py's time rows: a step under each checkpointing policy and precision, and MemoryMonitor's overhead.

Variants run side by side in one process, interleaved round by round after one untimed warm-up round;
each variant's fastest step is compared with the baseline's (ratios: absolute times are noise).

Example::

    >>> list(POLICIES)
    ['none', 'selective', 'full', 'offload']
"""

from __future__ import annotations

import time
from typing import Any

import torch
from truth_cases import Case, repeated
from truth_device import TruthDevice
from truth_rows import row

from lightning_memopt.callbacks import MemoryMonitor, TrainingSummary
from lightning_memopt.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_memopt.memory.figures import CPU_FIGURES, CUDA_FIGURES
from lightning_memopt.memory.step_parts import quiet_logging, training_step_fn
from lightning_memopt.planner.step_time import predicted_step_costs

POLICIES: dict[str, Any] = {"none": None, "selective": "selective", "full": "preset", "offload": "offload"}
# (variant, policy, precision); the last is compared with the first: the same step in bf16-mixed
_VARIANTS = [(name, policy, "32-true") for name, policy in POLICIES.items()] + [("bf16-mixed", None, "bf16-mixed")]


def _timed_step(device: TruthDevice, module: torch.nn.Module, batch: Any, precision: str) -> float:
    step = training_step_fn(module, None)
    half = precision == "bf16-mixed"
    module.zero_grad(set_to_none=True)
    device.synchronize()
    started = time.perf_counter()
    with torch.autocast(device.device.type, dtype=torch.bfloat16, enabled=half, cache_enabled=False), quiet_logging():
        loss = step(batch)
    loss.backward()
    device.synchronize()
    return time.perf_counter() - started


def step_time_rows(device: TruthDevice, case: Case, rounds: int) -> list[dict]:
    """Forward + backward of ``case`` under each policy (fp32), and in bf16-mixed, on ``device``."""
    device.release()
    torch.manual_seed(0)
    with device.device:
        module = case.build()
    module.train()
    batch = device.to_device(case.batch())
    times: dict[str, list[float]] = {name: [] for name, _, _ in _VARIANTS}
    for round_index in range(rounds + 1):
        for name, policy, precision in _VARIANTS:
            remove_activation_checkpointing(module)
            if policy is not None:
                apply_activation_checkpointing(module, policy)
            seconds = _timed_step(device, module, batch, precision)
            if round_index:  # round 0 warms every variant up
                times[name].append(seconds)
    del module, batch
    device.release()
    fastest = {name: min(values) for name, values in times.items()}
    predicted = predicted_ratios(device, case)
    return [
        row(
            "step time",
            case.name,
            name if name in POLICIES else f"{name} (32-true = 1)",
            seconds=fastest[name],
            ratio=fastest[name] / fastest["none"],
            predicted_ratio=predicted[name],
            note="checkpointing: over none" if name in POLICIES else "precision: over 32-true",
        )
        for name, _, _ in _VARIANTS
    ]


def predicted_ratios(device: TruthDevice, case: Case) -> dict[str, float]:
    """The planner's ratio of each variant of :data:`_VARIANTS` to its baseline, priced for ``device`` (fake-mode
    profiles on the host)."""
    hardware = device.hardware()
    batch = case.batch()
    costs = predicted_step_costs(case.build, batch, hardware, POLICIES)
    half = predicted_step_costs(case.build, batch, hardware, {"none": None}, precision="bf16-mixed")["none"]
    ratios = {name: cost.total / costs["none"].total for name, cost in costs.items()}
    return {**ratios, "bf16-mixed": half.total / costs["none"].total}


def monitor_rows(device: TruthDevice, case: Case, steps: int, rounds: int) -> list[dict]:
    """Fit time with MemoryMonitor (every step, and its default every 50) over without; its figures on this device."""
    settings = {"without": None, "every_n_steps=1": 1, "every_n_steps=50": 50}
    seconds = dict.fromkeys(settings, 0.0)
    logged: dict[str, float] = {}
    for _ in range(rounds):
        for name, every in settings.items():
            device.release()
            torch.manual_seed(0)
            summary = TrainingSummary()
            monitor = MemoryMonitor(every_n_steps=every) if every else None
            trainer = device.trainer(steps, [summary] + ([monitor] if monitor else []))
            trainer.fit(case.build(), repeated(case.batch(), steps))
            seconds[name] += summary.summary.train_seconds
            if every == 1:
                logged = monitor.last_logged
    expected = CUDA_FIGURES if device.is_cuda else CPU_FIGURES
    missing = [name for name in expected if f"memopt/{name}" not in logged]
    rows = []
    for name, every in settings.items():
        if every is None:
            continue
        checked = every == 1
        note = f"{steps} steps; logged: " + ", ".join(sorted(key.split("/", 1)[1] for key in logged)) if checked else ""
        if missing and checked:
            note += f"; missing: {', '.join(missing)}"
        rows.append(
            row(
                "monitor",
                case.name,
                name,
                seconds=seconds[name] / rounds,
                ratio=seconds[name] / seconds["without"],
                passed=not missing if checked else None,
                note=note,
            )
        )
    return rows
