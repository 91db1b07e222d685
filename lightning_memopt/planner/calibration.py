"""Calibration: this CPU timed as a :class:`~lightning_memopt.planner.hardware.Hardware`, to plan a run on it.

Off CUDA (a :class:`~lightning_memopt.memory.SimulatedDevice`, ``MemoryBudget`` on the CPU) the
rates are measured: fp32 and bf16 matmuls, a large copy, and the host's time per kernel and what
checkpointing adds in each mode (:func:`~lightning_memopt.planner.host.measure_host`).

They are measured once per machine (its processor, its threads, torch's version) and kept in
``$LIGHTNING_MEMOPT_CACHE/cpu_rates.json`` (default ``~/.cache/lightning_memopt``): rates timed again on
every plan moved with the machine's load, so the same candidate was priced at 3.91 s and at 0.29 s.
``measure_cpu(refresh=True)`` times them again. The same folder (:func:`cache_folder`) keeps the candidates timed on
a device (:mod:`~lightning_memopt.planner.remembered`); deleting a file makes the project measure again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.host import measure_host
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import GB, MIB

_MEASURED: dict[str, Hardware] = {}  # this process's: the file is read once
# 2: region costs per wrapped call and per forward op (1: per forward kernel, which rates of 1 must not be read as)
RATES_VERSION = 2


def measure_cpu(memory_bytes: int, size: int = 384, repeats: int = 5, refresh: bool = False) -> Hardware:
    """This CPU's rates, timed: fp32 and bf16 matmuls, a large copy, and a small training step — its
    host time per kernel and what checkpointing one of its blocks adds in each mode. Timed once per machine
    and cached (module docstring); ``refresh`` times them again.

    ``memory_bytes`` is the budget (a :class:`~lightning_memopt.memory.SimulatedDevice`'s); the
    host link, the peer link and the host's memory bandwidth are a copy in memory. Its tensors are the
    host's own: a tracker, fake mode or ``SimulatedDevice`` around the call sees none of them.

    Example::

        >>> measure_cpu(2**30).memory_bytes, measure_cpu(0).full_tflops == measure_cpu(0).full_tflops
        (1073741824, True)
    """
    key = machine_key()
    hardware = None if refresh else _MEASURED.get(key) or _read_cache(key)
    if hardware is None:
        with disable_current_modes():
            hardware = _timed_rates(0, size, repeats)
        _write_cache(key, hardware)
    _MEASURED[key] = hardware
    return dataclasses.replace(hardware, memory_bytes=memory_bytes, host_is_device=True)


def machine_key() -> str:
    """What the cached rates belong to: the processor, torch's threads and version, and what the rates mean."""
    return f"{_processor()}; {torch.get_num_threads()} threads; torch {torch.__version__}; rates {RATES_VERSION}"


@functools.cache
def _processor() -> str:
    """The processor's model name (read once: it does not change while the process runs; the threads may)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cache_path() -> Path:
    """Where the measured rates are kept."""
    return cache_folder() / "cpu_rates.json"


def _read_cache(key: str) -> Hardware | None:
    try:
        fields = json.loads(cache_path().read_text())[key]
        regions = {mode: tuple(seconds) for mode, seconds in fields.pop("region_seconds").items()}
        return Hardware(**fields, region_seconds=regions)
    except (OSError, ValueError, KeyError, TypeError):  # none yet, unreadable, or of another version: time again
        return None


def _write_cache(key: str, hardware: Hardware) -> None:
    path = cache_path()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known[key] = dataclasses.asdict(hardware)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1, sort_keys=True))
    except OSError:  # a read-only home: the rates stay this process's
        pass


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


CACHE_VARIABLE = "LIGHTNING_MEMOPT_CACHE"


def cache_folder() -> Path:
    """``$LIGHTNING_MEMOPT_CACHE``, else ``~/.cache/lightning_memopt``."""
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "lightning_memopt")
