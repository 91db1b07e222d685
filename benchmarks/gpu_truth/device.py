"""Where gpu_truth.py measures: a CUDA device through its caching allocator, or the CPU through the tracker.

Both answer the same questions — the peak of allocated (and, on CUDA, reserved) bytes while a block
runs, a device capped at some bytes so that a step runs out of memory for real, a clock that waits for
the device — so that the dry run on a CPU walks the code a GPU run walks.

Example (CPU)::

    >>> device = TruthDevice.detect(prefer_cuda=False)
    >>> with device.peaks() as peak:
    ...     kept = torch.zeros(1024)
    >>> peak.allocated
    4096
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from bench import cpu_trainer
from torch import nn

from lightning_memopt.memory import MemoryTracker, SimulatedDevice
from lightning_memopt.planner import Hardware, cuda_hardware, measure_cpu

_MIB = 2**20


@dataclass
class Peak:
    """The most bytes a block held at once: ``allocated`` by tensors, ``reserved`` by the allocator (NaN off CUDA)."""

    allocated: int = 0
    reserved: float = math.nan

    @property
    def held(self) -> float:
        """What the device held: the allocator's reserve on CUDA, the tensors' bytes where nothing caches them."""
        return self.allocated if math.isnan(self.reserved) else self.reserved


def _driver_version() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return done.stdout.strip().splitlines()[0]


@dataclass
class TruthDevice:
    """The device the truth is measured on, with what identifies it in the CSV."""

    device: torch.device
    name: str
    driver: str
    total_bytes: int
    context_bytes: int  # memory the device holds outside PyTorch's allocator (the CUDA context); 0 on a CPU

    @classmethod
    def detect(cls, prefer_cuda: bool = True) -> TruthDevice:
        """The first CUDA device when there is one (and ``prefer_cuda``), else the CPU."""
        if prefer_cuda and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            torch.zeros(1, device=device)  # the context exists from here on
            free, total = torch.cuda.mem_get_info(device)
            context = total - free - torch.cuda.memory_reserved(device)
            name = torch.cuda.get_device_name(device)
            driver = f"driver {_driver_version()}, CUDA {torch.version.cuda}, torch {torch.__version__}"
            return cls(device, name, driver, total, context)
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(torch.device("cpu"), name, f"no driver, torch {torch.__version__}", total, 0)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def hardware(self) -> Hardware:
        """What the planner prices a step on here: the CUDA device's catalogue entry, or this CPU, measured."""
        return cuda_hardware(self.device) if self.is_cuda else measure_cpu(0)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop what earlier measurements left: garbage, and the allocator's cached blocks."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors, or tuples / lists / dicts of them) moved to the device."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device)
        if isinstance(batch, dict):
            return {key: self.to_device(value) for key, value in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(value) for value in batch)
        return batch

    @contextlib.contextmanager
    def peaks(self, include: tuple[nn.Module, ...] = ()) -> Iterator[Peak]:
        """Measure the block's peak; on the CPU the tracker counts ``include``'s parameters as present already."""
        peak = Peak()
        if self.is_cuda:
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            yield peak
            self.synchronize()
            peak.allocated = torch.cuda.max_memory_allocated(self.device)
            peak.reserved = torch.cuda.max_memory_reserved(self.device)
            return
        tracker = MemoryTracker(round_to=512)
        for module in include:
            tracker.track_module(module)
        with tracker:
            yield peak
        peak.allocated = tracker.peak.total_bytes

    @contextlib.contextmanager
    def capped(self, budget_bytes: int, include: tuple[nn.Module, ...] = ()) -> Iterator[Peak]:
        """A device of ``budget_bytes``: a real out-of-memory error past it; the block's peak measured.

        On CUDA through ``torch.cuda.set_per_process_memory_fraction`` (the allocator's reserve is capped);
        on the CPU through :class:`~lightning_memopt.memory.SimulatedDevice` (``include`` counted as present).
        """
        if not self.is_cuda:
            simulated = SimulatedDevice(budget_bytes, include=include)
            with simulated:
                yield (peak := Peak())
            peak.allocated = simulated.peak.total_bytes
            return
        torch.cuda.set_per_process_memory_fraction(budget_bytes / self.total_bytes, self.device)
        try:
            with self.peaks() as peak:
                yield peak
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.release()

    def describe(self) -> str:
        """One line: the device, its memory, its driver."""
        context = f", CUDA context {self.context_bytes / _MIB:.0f} MiB" if self.is_cuda else ""
        return f"{self.name} ({self.total_bytes / 2**30:.1f} GiB{context}); {self.driver}"

    def trainer(self, steps: int, callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
        """A Trainer on this device for ``steps`` steps, without logger, checkpoints, progress bar or summary."""
        devices = [self.device.index] if self.is_cuda else 1
        return cpu_trainer(steps, callbacks, accelerator=self.device.type, devices=devices, num_sanity_val_steps=0,
                           **options)  # fmt: skip
