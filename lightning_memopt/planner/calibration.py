"""Calibration: this CPU timed as a :class:`~lightning_memopt.planner.hardware.Hardware`, to plan a run on it.

Off CUDA (a :class:`~lightning_memopt.memory.SimulatedDevice`, ``MemoryBudget`` on the CPU) the
rates are measured: fp32 and bf16 matmuls, a large copy, and the host's time per kernel and what
checkpointing adds in each mode (:func:`~lightning_memopt.planner.host.measure_host`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.host import measure_host
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import GB, MIB


def measure_cpu(memory_bytes: int, size: int = 384, repeats: int = 5) -> Hardware:
    """This CPU's rates, timed: fp32 and bf16 matmuls, a large copy, and a small training step — its
    host time per kernel and what checkpointing one of its blocks adds in each mode.

    ``memory_bytes`` is the budget (a :class:`~lightning_memopt.memory.SimulatedDevice`'s); the
    host link, the peer link and the host's memory bandwidth are a copy in memory. Its tensors are the
    host's own: a tracker, fake mode or ``SimulatedDevice`` around the call sees none of them.
    """
    with disable_current_modes():
        return _timed_rates(memory_bytes, size, repeats)


def _timed_rates(memory_bytes: int, size: int, repeats: int) -> Hardware:
    a = torch.randn(size, size)
    half = a.bfloat16()
    big = torch.empty(8 * MIB // 4)

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    flops = 2 * size**3
    full = flops / best(lambda: a @ a) / 1e12
    half_rate = flops / best(lambda: half @ half) / 1e12
    copy = 2 * big.nbytes / best(lambda: big.clone()) / GB
    host = measure_host()
    return Hardware(
        "cpu",
        memory_bytes,
        True,
        full,
        half_rate,
        memory_gbps=copy,
        host_link_gbps=copy,
        peer_link_gbps=copy,
        host_memory_gbps=copy,
        kernel_seconds=host.kernel_seconds,
        region_seconds=dict(host.region_seconds),
        fused_attention_wins=False,
        host_overlaps=False,
        device_type="cpu",
        workspace=None,
    )
