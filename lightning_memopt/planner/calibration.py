"""Calibration: this CPU timed as a :class:`~lightning_memopt.planner.hardware.Hardware`, to plan a run on it.

Off CUDA (a :class:`~lightning_memopt.memory.SimulatedDevice`, ``MemoryBudget`` on the CPU) the
rates are measured: fp32 and bf16 matmuls, a large copy, and small training steps for the host
time per kernel and what checkpointing one block adds in each mode (a GPU's kernels hide the
latter, so the catalogue has none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from lightning_memopt.checkpointing.wrap import checkpoint_modules
from lightning_memopt.memory.work import WorkCounter
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import CHECKPOINT_KNOBS, CHECKPOINT_MODES, GB, MIB


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
    kernel, regions = _small_step_seconds(best)
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
        kernel_seconds=kernel,
        region_seconds=regions,
        fused_attention_wins=False,
    )


class _Block(nn.Module):
    """``depth`` small linear + GELU layers with a residual: a block of a few (depth 1) or many kernels."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + x


def _train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def _kernels(run: Callable[[], object]) -> float:
    counter = WorkCounter()
    with counter:
        run()
    return counter.total().kernels


def _small_step_seconds(
    best: Callable[[Callable[[], object]], float], blocks: int = 8
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Training steps of small blocks: the host time per kernel (dispatch, autograd, module calls), and
    what checkpointing a block adds in each mode — a fixed cost per call and one per forward kernel in
    it, from blocks of two depths."""
    x = torch.randn(4, 8)
    extra: dict[str, list[tuple[float, float]]] = {mode: [] for mode in CHECKPOINT_MODES}
    kernel = 0.0
    for depth in (1, 4):
        seconds = {}
        for mode in CHECKPOINT_KNOBS:
            model = nn.Sequential(*(_Block(depth) for _ in range(blocks)))
            if mode != "none":
                checkpoint_modules(model, {"modules": [str(i) for i in range(blocks)], "mode": mode})
            seconds[mode] = best(partial(_train_step, model, x))
        plain = nn.Sequential(*(_Block(depth) for _ in range(blocks)))
        kernel = seconds["none"] / _kernels(partial(_train_step, plain, x))
        block_kernels = _kernels(partial(plain[0], x))
        for mode in CHECKPOINT_MODES:
            extra[mode].append((block_kernels, max(0.0, (seconds[mode] - seconds["none"]) / blocks)))
    regions = {}
    for mode, ((few, few_seconds), (many, many_seconds)) in extra.items():
        per_kernel = max(0.0, (many_seconds - few_seconds) / (many - few))
        regions[mode] = (max(0.0, few_seconds - per_kernel * few), per_kernel)
    return kernel, regions
