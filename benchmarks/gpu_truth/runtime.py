"""gpu_truth.py's time rows: a step under each checkpointing policy and precision, and MemoryMonitor's overhead.

Variants run side by side in one process, interleaved round by round after one untimed warm-up round
(selective's: its timed calls, after which each block keeps its expensive ops or recomputes in full);
each variant's fastest step is compared with the baseline's (ratios: absolute times are noise).

Example::

    >>> list(POLICIES)
    ['none', 'selective', 'full', 'offload']
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from lightning_memopt.callbacks import MemoryMonitor, TrainingSummary
from lightning_memopt.checkpointing import (
    apply_activation_checkpointing,
    offload_stats,
    release_offload_buffers,
    remove_activation_checkpointing,
)
from lightning_memopt.checkpointing.selective_payoff import TIMED_CALLS
from lightning_memopt.memory.figures import CPU_FIGURES, CUDA_FIGURES
from lightning_memopt.memory.step_parts import quiet_logging, training_step_fn
from lightning_memopt.planner.step_time import predicted_step_costs

from .cases import Case, repeated
from .device import TruthDevice
from .rows import row

POLICIES: dict[str, Any] = {"none": None, "selective": "selective", "full": "preset", "offload": "offload"}
# issue 38's ratios over none at sizes that keep a GPU busy (offload's: over the larger of the unchecked step and
# its bytes' time on the host link, out and back in)
FULL_TARGET, SELECTIVE_TARGET, OFFLOAD_TARGET = 1.38, 1.10, 1.15
_LINK_PROBE_BYTES = 256 * 2**20
# (variant, policy, precision); the last is compared with the first: the same step in bf16-mixed
_VARIANTS = [(name, policy, "32-true") for name, policy in POLICIES.items()] + [("bf16-mixed", None, "bf16-mixed")]


def _timed_step(device: TruthDevice, module: torch.nn.Module, batch: Any, precision: str) -> tuple[float, int]:
    """The step's seconds, and the bytes its forward left offloaded on the host (counted outside the clock)."""
    step = training_step_fn(module, None)
    half = precision == "bf16-mixed"
    module.zero_grad(set_to_none=True)
    device.synchronize()
    started = time.perf_counter()
    with torch.autocast(device.device.type, dtype=torch.bfloat16, enabled=half, cache_enabled=False), quiet_logging():
        loss = step(batch)
    paused = time.perf_counter()
    offloaded = offload_stats().host_bytes
    resumed = time.perf_counter()
    loss.backward()
    device.synchronize()
    return time.perf_counter() - started - (resumed - paused), offloaded


def link_seconds_per_byte(device: TruthDevice) -> float:
    """Seconds a byte takes to the host and back over the host link (pinned memory, fastest of 3); 0 on a CPU."""
    if not device.is_cuda:
        return 0.0
    on_device = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, device=device.device)
    on_host = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    fastest = {"out": math.inf, "in": math.inf}
    for _ in range(3):
        for way, (target, source) in {"out": (on_host, on_device), "in": (on_device, on_host)}.items():
            device.synchronize()
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            device.synchronize()
            fastest[way] = min(fastest[way], time.perf_counter() - started)
    del on_device, on_host
    return (fastest["out"] + fastest["in"]) / _LINK_PROBE_BYTES


def judged(name: str, ratios: dict[str, float], link_ratio: float, on_gpu: bool) -> tuple[bool | None, str]:
    """Whether variant ``name`` meets issue 38's target (None off a GPU: a CPU's ratio is no GPU claim), and why.

    ``link_ratio``: the offloaded bytes' time out and back over the host link, over the unchecked step.

    Example::

        >>> judged("selective", {"none": 1.0, "selective": 1.2, "full": 1.3, "offload": 2.0}, 0.5, True)
        (False, 'target ≤ 1.1× and ≤ full (1.3×)')
        >>> judged("offload", {"none": 1.0, "selective": 1.2, "full": 1.3, "offload": 2.0}, 1.8, True)
        (True, 'target ≤ 1.15 × max(1, link 1.8×) = 2.07×')
    """
    if name == "full":
        limit, why = FULL_TARGET, f"target ≤ {FULL_TARGET:g}×"
    elif name == "selective":
        limit = min(SELECTIVE_TARGET, ratios["full"])
        why = f"target ≤ {SELECTIVE_TARGET:g}× and ≤ full ({ratios['full']:.3g}×)"
    elif name == "offload":
        limit = OFFLOAD_TARGET * max(1.0, link_ratio)
        why = f"target ≤ {OFFLOAD_TARGET:g} × max(1, link {link_ratio:.3g}×) = {limit:.3g}×"
    else:
        return None, ""
    if not on_gpu:
        return None, f"GPU {why} (a CPU's ratio is not judged)"
    return ratios[name] <= limit, why


def step_time_rows(device: TruthDevice, case: Case, rounds: int, targeted: bool = False) -> list[dict]:
    """Forward + backward of ``case`` under each policy (fp32), and in bf16-mixed, on ``device``; ``targeted``: the
    case keeps a GPU busy and its ratios are held to issue 38's targets."""
    device.release()
    torch.manual_seed(0)
    with device.device:
        module = case.build()
    module.train()
    batch = device.to_device(case.batch())
    times: dict[str, list[float]] = {name: [] for name, _, _ in _VARIANTS}
    offloaded = 0
    for round_index in range(rounds + 1):
        for name, policy, precision in _VARIANTS:
            remove_activation_checkpointing(module)
            if policy is not None:
                apply_activation_checkpointing(module, policy)
            # round 0 warms every variant up; selective's blocks through their timed calls, which decide per block
            # whether keeping pays (the verdict outlives the re-wrapping)
            for _ in range(1 if round_index or policy != "selective" else TIMED_CALLS):
                seconds, held = _timed_step(device, module, batch, precision)
            offloaded = max(offloaded, held)
            if round_index:
                times[name].append(seconds)
    remove_activation_checkpointing(module)
    del module, batch
    release_offload_buffers()
    device.release()
    fastest = {name: min(values) for name, values in times.items()}
    ratios = {name: fastest[name] / fastest["none"] for name in fastest}
    link_ratio = offloaded * link_seconds_per_byte(device) / fastest["none"]
    predicted = predicted_ratios(device, case)
    rows = []
    for name, _, _ in _VARIANTS:
        passed, why = judged(name, ratios, link_ratio, device.is_cuda) if targeted else (None, "")
        note = "checkpointing: over none" if name in POLICIES else "precision: over 32-true"
        if name == "offload":
            note += f"; {offloaded / 2**20:.0f} MiB offloaded"
        rows.append(
            row(
                "step time",
                case.name,
                name if name in POLICIES else f"{name} (32-true = 1)",
                seconds=fastest[name],
                ratio=ratios[name],
                predicted_ratio=predicted[name],
                passed=passed,
                note="; ".join(filter(None, (note, why))),
            )
        )
    return rows


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
