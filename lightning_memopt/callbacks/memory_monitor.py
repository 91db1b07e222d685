"""MemoryMonitor: log memory every N steps, and leave a diagnosis behind when a step runs out of it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_int, check_optional_int, check_path
from lightning_memopt.memory.oom import is_oom_error
from lightning_memopt.memory.report import format_report, write_timeline_chart
from lightning_memopt.memory.tracker import MemoryTracker

_GB = 1e9


class MemoryMonitor(Callback):
    """Log ``memopt/*`` memory figures every ``every_n_steps`` and write an OOM diagnosis on failure.

    On CUDA it logs the caching allocator's peak allocated, reserved and active memory (GB),
    fragmentation (1 − allocated / reserved) and allocator retries, from ``torch.cuda.memory_stats``;
    on other devices, the live tensor bytes and the peak of that step counted by a
    :class:`MemoryTracker` that runs through the sampled step only (one step in ``every_n_steps``,
    so the Python-level accounting costs little). ``last_logged`` holds the latest figures. Under DDP every rank's value
    is logged (``…_rank{i}``) with the minimum and maximum across ranks. Peaks are reset after each log.

    When a training step raises an out-of-memory error it writes, into ``report_dir``:
    ``oom_report.txt`` (live memory by category and top-level module, largest tensors, what to try
    with estimated savings), ``oom_timeline.png`` (memory over the failing step; needs matplotlib)
    and on CUDA ``oom_snapshot.pickle`` (allocator history; open it at https://pytorch.org/memory_viz).

    Args:
        every_n_steps: log every this many optimizer steps.
        report_dir: where OOM files go; default ``<trainer.default_root_dir>/memopt``.
        record_cuda_history: record CUDA allocator history for the snapshot (small overhead).
        prometheus_port: also serve the figures as Prometheus gauges on this port (+ local rank);
            needs ``prometheus_client`` (extra ``prometheus``).

    Raises:
        MisconfigurationException: for ``every_n_steps`` < 1, a port outside 1–65535, a value of the
            wrong type (``every_n_steps="abc"``, ``record_cuda_history="maybe"``), or a
            ``prometheus_port`` without ``prometheus_client`` installed.

    Example::

        >>> MemoryMonitor(every_n_steps=10).every_n_steps
        10
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        report_dir: str | Path | None = None,
        record_cuda_history: bool = True,
        prometheus_port: int | None = None,
    ) -> None:
        try:
            self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
            self.report_dir = Path(check_path("report_dir", report_dir)) if report_dir is not None else None
            self.record_cuda_history = check_bool("record_cuda_history", record_cuda_history)
            self.prometheus_port = check_optional_int("prometheus_port", prometheus_port, minimum=1, maximum=65535)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"MemoryMonitor: {error}") from None
        if self.prometheus_port is not None:
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                raise MisconfigurationException(
                    "MemoryMonitor: `prometheus_port` needs prometheus_client: "
                    "pip install 'lightning-memopt[prometheus]'"
                ) from None
        self.tracker: MemoryTracker | None = None
        self._gauges: dict[str, Any] = {}
        self._sampled_step = -1
        self._sampling = False
        self.last_tracked: MemoryTracker | None = None
        self.last_logged: dict[str, float] = {}

    # -- set-up and tear-down ------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if pl_module.device.type == "cuda" and self.record_cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.prometheus_port is not None:
            self._start_prometheus(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop(pl_module)

    def _stop(self, pl_module: LightningModule) -> None:
        # called from teardown, and from on_exception (Lightning skips teardown hooks after an error)
        self._stop_tracking()
        if pl_module.device.type == "cuda" and self.record_cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _stop_tracking(self) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker.remove_hooks()
            self.last_tracked = self.tracker
            self.tracker = None

    # -- one sampled step in every_n_steps -----------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps or trainer.global_step == self._sampled_step:
            return
        self._sampled_step = trainer.global_step
        self._sampling = True
        if pl_module.device.type == "cuda":
            return
        # off CUDA the figures come from a tracker that runs through this one step only
        self.tracker = MemoryTracker(record_timeline=True)
        self.tracker.track_training_state(pl_module, trainer.optimizers, batch)
        self.tracker.phase = "forward"
        self.tracker.__enter__()

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.phase = "backward"

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.tracker is not None:
            self.tracker.relabel_gradients(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.tracker is not None:
            self.tracker.phase = "optimizer"

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._sampling:
            return
        self._sampling = False
        if self.tracker is not None:
            for optimizer in trainer.optimizers:
                self.tracker.relabel_optimizer_state(optimizer)
        figures = self.read(pl_module.device)
        self._stop_tracking()
        self._log(trainer, pl_module, figures)

    # -- figures -------------------------------------------------------------------------------
    def read(self, device: torch.device) -> dict[str, float]:
        """The figures of the sampled step on ``device`` (the CUDA peak is reset afterwards)."""
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            allocated = stats.get("allocated_bytes.all.current", 0)
            reserved = stats.get("reserved_bytes.all.current", 0)
            figures = {
                "peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / _GB,
                "allocated_gb": allocated / _GB,
                "reserved_gb": reserved / _GB,
                "active_gb": stats.get("active_bytes.all.current", 0) / _GB,
                "fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
                "alloc_retries": float(stats.get("num_alloc_retries", 0)),
            }
            torch.cuda.reset_peak_memory_stats(device)
            return figures
        assert self.tracker is not None
        return {
            "peak_allocated_gb": self.tracker.peak.total_bytes / _GB,
            "allocated_gb": self.tracker.live_bytes / _GB,
        }

    def _log(self, trainer: Trainer, pl_module: LightningModule, figures: dict[str, float]) -> None:
        names = list(figures)
        values = torch.tensor([figures[n] for n in names], dtype=torch.float64, device=pl_module.device)
        logged: dict[str, float] = dict(zip((f"memopt/{n}" for n in names), figures.values(), strict=True))
        if trainer.world_size > 1:
            gathered = torch.as_tensor(pl_module.all_gather(values)).reshape(trainer.world_size, len(names))
            for column, name in enumerate(names):
                per_rank = gathered[:, column].tolist()
                logged[f"memopt/{name}_min"] = min(per_rank)
                logged[f"memopt/{name}_max"] = max(per_rank)
                logged.update({f"memopt/{name}_rank{rank}": value for rank, value in enumerate(per_rank)})
        self.last_logged = logged
        if trainer.is_global_zero:
            for logger in trainer.loggers:  # straight to the loggers, like LearningRateMonitor: no stale repeats
                logger.log_metrics(logged, step=trainer.global_step)
        for name, value in figures.items():
            if name in self._gauges:
                self._gauges[name].set(value)

    def _start_prometheus(self, trainer: Trainer) -> None:
        import prometheus_client

        assert self.prometheus_port is not None
        registry = prometheus_client.CollectorRegistry()
        names = ("peak_allocated_gb", "allocated_gb", "reserved_gb", "active_gb", "fragmentation", "alloc_retries")
        self._gauges = {
            name: prometheus_client.Gauge(f"memopt_{name}", f"lightning_memopt {name}", registry=registry)
            for name in names
        }
        prometheus_client.start_http_server(self.prometheus_port + trainer.local_rank, registry=registry)

    # -- out of memory -------------------------------------------------------------------------
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if is_oom_error(exception):
            directory = self.report_dir or Path(trainer.default_root_dir) / "memopt"
            directory.mkdir(parents=True, exist_ok=True)
            title = f"out of memory at step {trainer.global_step}"
            written = self.write_oom_report(directory, pl_module.device, title)
            rank_zero_info(f"MemoryMonitor: out of memory; wrote {', '.join(str(p) for p in written)}")
        self._stop(pl_module)

    def write_oom_report(self, directory: Path, device: torch.device, title: str) -> list[Path]:
        """Write the OOM files for ``device`` into ``directory``; returns the paths written."""
        written = []
        if device.type == "cuda":
            snapshot_path = directory / "oom_snapshot.pickle"
            with snapshot_path.open("wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(device), f)
            report_path = directory / "oom_report.txt"
            report_path.write_text(f"{title}\n\n{torch.cuda.memory_summary(device)}\n")
            return [snapshot_path, report_path]
        tracker = self.tracker or self.last_tracked
        if tracker is None:
            return []
        if self.tracker is None:  # the failing step was not sampled: describe the last one that was
            title += f" (memory of the last sampled step, {self._sampled_step}; the failing step was not tracked)"
        report_path = directory / "oom_report.txt"
        report_path.write_text(format_report(tracker.peak, title))
        written.append(report_path)
        chart_path = directory / "oom_timeline.png"
        if tracker.timeline and write_timeline_chart(tracker.timeline, chart_path, title):
            written.append(chart_path)
        return written
