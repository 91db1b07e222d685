"""The memory figures a monitor logs: from the CUDA allocator, or from a tracker off CUDA; the OOM files."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from lightning_memopt.memory.cuda_peak import reset_peak
from lightning_memopt.memory.report import format_report, write_timeline_chart
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.private_api import cuda_memory_snapshot
from lightning_memopt.vocabulary import GB

# the figures each kind of device has
CPU_FIGURES = ("peak_allocated_gb", "allocated_gb")
CUDA_FIGURES = ("peak_allocated_gb", "allocated_gb", "reserved_gb", "active_gb", "fragmentation", "alloc_retries")


def cuda_figures(device: torch.device) -> dict[str, float]:
    """The allocator's figures on ``device`` since its peak was last reset (which this resets).

    Memory in decimal GB, as the ``*_gb`` names say; ``fragmentation`` is the reserved share not
    allocated; ``alloc_retries`` counts the allocator's flush-and-retry events.
    """
    stats = torch.cuda.memory_stats(device)
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    figures = {
        "peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / GB,
        "allocated_gb": allocated / GB,
        "reserved_gb": reserved / GB,
        "active_gb": stats.get("active_bytes.all.current", 0) / GB,
        "fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }
    reset_peak(device)  # (a fit's peak is kept apart for TrainingSummary)
    return figures


def tracker_figures(tracker: MemoryTracker) -> dict[str, float]:
    """A tracker's peak and live bytes in decimal GB (:data:`CPU_FIGURES`).

    Example::

        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     kept = torch.ones(250_000)
        >>> tracker_figures(tracker)
        {'peak_allocated_gb': 0.001, 'allocated_gb': 0.001}
    """
    return {"peak_allocated_gb": tracker.peak.total_bytes / GB, "allocated_gb": tracker.live_bytes / GB}


def write_oom_files(
    directory: Path, device: torch.device, tracker: MemoryTracker | None, title: str, devices: int | None = None
) -> list[Path]:
    """Write what an out-of-memory error leaves behind into ``directory``; the paths written (``devices``: how many
    the run has, which the advice on sharding names).

    On CUDA: ``oom_snapshot.pickle`` (the allocator's history, for https://pytorch.org/memory_viz)
    and ``oom_report.txt`` (``torch.cuda.memory_summary``). Elsewhere, from ``tracker``:
    ``oom_report.txt`` (live memory by category and module, largest tensors, what to try) and
    ``oom_timeline.png`` (needs matplotlib); nothing without a tracker.
    """
    if device.type == "cuda":
        snapshot_path = directory / "oom_snapshot.pickle"
        with snapshot_path.open("wb") as f:
            pickle.dump(cuda_memory_snapshot(device), f)
        report_path = directory / "oom_report.txt"
        report_path.write_text(f"{title}\n\n{torch.cuda.memory_summary(device)}\n")
        return [snapshot_path, report_path]
    if tracker is None:
        return []
    report_path = directory / "oom_report.txt"
    report_path.write_text(format_report(tracker.peak, title, devices=devices))
    written = [report_path]
    chart_path = directory / "oom_timeline.png"
    if tracker.timeline and write_timeline_chart(tracker.timeline, chart_path, title):
        written.append(chart_path)
    return written
