"""The memory figures a monitor logs and serves: from the CUDA allocator, or a tracker off CUDA; the OOM files.

The CUDA allocator's peak is shared by callbacks that reset it at different times (:func:`reset_peak`,
:func:`peak_since_mark`); :class:`PrometheusGauges` serves a few figures over HTTP for Prometheus to scrape.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

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


# device index -> the highest peak of allocated bytes folded in since the last mark
_high_water: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_peak(device: torch.device) -> None:
    """Reset the allocator's peak of ``device``, keeping the peak so far for :func:`peak_since_mark`.

    ``torch.cuda.reset_peak_memory_stats`` resets one counter per device for the whole process: a
    monitor that resets it after each sample would leave a fit-long reader with the peak since that
    sample only. This function first folds the peak so far into a
    per-device high-water mark, and read the fit's peak with :func:`peak_since_mark`.

    Example::

        >>> import torch
        >>> if torch.cuda.is_available():
        ...     device = torch.device("cuda")
        ...     mark_peak(device)
        ...     reset_peak(device)  # a monitor's window ends: the fit's peak is kept
        ...     assert peak_since_mark(device) >= 0
    """
    index = _index(device)
    _high_water[index] = max(_high_water.get(index, 0), torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


def mark_peak(device: torch.device) -> None:
    """Start a new window on ``device``: reset the allocator's peak and forget the high-water mark."""
    _high_water.pop(_index(device), None)
    torch.cuda.reset_peak_memory_stats(device)


def peak_since_mark(device: torch.device) -> int:
    """The highest allocated bytes on ``device`` since :func:`mark_peak`, across every :func:`reset_peak`."""
    return max(_high_water.get(_index(device), 0), torch.cuda.max_memory_allocated(device))


class PrometheusGauges:
    """An HTTP endpoint with one gauge ``memopt_<name>`` per name, in a registry of its own.

    A gauge appears with its first value: before it, none (rather than a 0 that was never measured).
    Figures of other names are ignored. :meth:`close` shuts the server down, so the port can be
    served again in the same process. Needs ``prometheus_client``.

    Args:
        names: the figures served.
        address: the interface to listen on (``"127.0.0.1"``: this machine only).
        port: the TCP port.

    Raises:
        OSError: when the port cannot be bound (in use, or the address is not this machine's).

    Example::

        >>> import socket, urllib.request
        >>> with socket.socket() as probe:
        ...     _ = probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]
        >>> gauges = PrometheusGauges(["peak_allocated_gb"], "127.0.0.1", port)
        >>> gauges.set({"peak_allocated_gb": 1.5, "unserved": 2.0})
        >>> body = urllib.request.urlopen(gauges.url, timeout=10).read().decode()
        >>> [line for line in body.splitlines() if line.startswith("memopt_")]
        ['memopt_peak_allocated_gb 1.5']
        >>> gauges.close()
    """

    def __init__(self, names: Iterable[str], address: str, port: int) -> None:
        import prometheus_client

        self._registry = prometheus_client.CollectorRegistry()
        self._gauges: dict[str, Any] = dict.fromkeys(names)
        server = prometheus_client.start_http_server(port, addr=address, registry=self._registry)
        # prometheus_client ≥ 0.17 returns (server, thread); older ones nothing, and their server stays up
        self.server = server if isinstance(server, tuple) else None
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{port}/metrics"

    def set(self, figures: Mapping[str, float]) -> None:
        """Set the gauge of each served name in ``figures``."""
        import prometheus_client

        for name, value in figures.items():
            if name not in self._gauges:
                continue
            gauge = self._gauges[name]
            if gauge is None:
                gauge = prometheus_client.Gauge(f"memopt_{name}", f"lightning_memopt {name}", registry=self._registry)
                self._gauges[name] = gauge
            gauge.set(value)

    def close(self) -> None:
        """Shut the server down and free its port."""
        if self.server is not None:
            server, thread = self.server
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
            self.server = None
