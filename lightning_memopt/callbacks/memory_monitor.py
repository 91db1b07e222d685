"""MemoryMonitor: log memory every N steps, and leave a diagnosis behind when a step runs out of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_bind_address, check_bool, check_int, check_optional_int, check_path
from lightning_memopt.memory.allocator import is_oom_error
from lightning_memopt.memory.compiled import compiled_parts
from lightning_memopt.memory.figures import (
    CPU_FIGURES,
    CUDA_FIGURES,
    PrometheusGauges,
    cuda_figures,
    tracker_figures,
    write_oom_files,
)
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.private_api import ends_optimizer_step, logging_step, record_cuda_memory_history, tree_flatten


class MemoryMonitor(Callback):
    """Log ``memopt/*`` memory figures every ``every_n_steps`` and write an OOM diagnosis on failure.

    On CUDA it logs the caching allocator's peak allocated (since the previous sample, so no spike
    between samples is missed), allocated, reserved and active memory (GB), fragmentation
    (1 − allocated / reserved) and allocator retries, from ``torch.cuda.memory_stats``; on other
    devices, the live tensor bytes at the end of the sampled optimizer step and the peak within it,
    counted by a :class:`MemoryTracker` that runs through that step only (all its micro-batches under
    gradient accumulation), so the Python-level accounting costs little.

    Sampled: the first optimizer step of each fit and every step ``s`` (0-based) with
    ``(s + 1) % every_n_steps == 0``, the steps Lightning logs with ``log_every_n_steps=every_n_steps``
    (and ``ModelCheckpoint(every_n_train_steps=every_n_steps)`` saves after). The figures go to the loggers at
    Lightning's logging step of that batch, the ``step`` its ``self.log(...)`` values get, once per step, and
    into ``trainer.callback_metrics`` (``ModelCheckpoint`` / ``EarlyStopping`` can monitor them); ``prog_bar``
    shows the peak on the progress bar. ``last_logged`` holds the latest figures, ``last_logged_step`` their
    step. Under DDP every rank's value is logged as well (``…_rank{i}``), with the minimum and maximum across
    ranks (``…_min``, ``…_max``); the plain key is this rank's value (rank 0's in the loggers).

    The CPU tracker, a ``TorchDispatchMode``, would turn ``torch.compile`` off for the rest of the run (dynamo
    never compiles a frame it first met under such a mode): on a model that runs compiled code (see
    :func:`compiled_parts`) it is skipped, with one warning, and no CPU figures are logged. CUDA figures
    come from the allocator and work with compiled code.

    When a training step raises an out-of-memory error it writes, into ``report_dir``:
    ``oom_report.txt`` (live memory by category and top-level module, largest tensors, what to try
    with estimated savings), ``oom_timeline.png`` (memory over the failing step; needs matplotlib)
    and on CUDA ``oom_snapshot.pickle`` (the allocator's segments and blocks live at the failure, and with
    ``record_cuda_history=True`` where each block was allocated; open it at https://pytorch.org/memory_viz).

    Args:
        every_n_steps: sample every this many optimizer steps (and the first).
        report_dir: where OOM files go; default ``<trainer.default_root_dir>/memopt``.
        record_cuda_history: record the CUDA allocator's history (a stack trace for every allocation) from
            fit start, so that the OOM snapshot shows where each block came from. Off by default: on an
            H200 it made a fit 1.43× slower, sampled or not (``benchmarks/gpu_truth.py``'s monitor rows).
        prometheus_port: also serve the device's figures as Prometheus gauges (``memopt_peak_allocated_gb``,
            …; on the CPU only the two it has) on this port (+ local rank), from fit start to teardown;
            needs ``prometheus_client`` (extra ``prometheus``).
        prometheus_address: the interface that server binds: ``"127.0.0.1"`` (the default) serves this
            machine only; ``"0.0.0.0"`` (or ``"::"``) every interface, which anyone who can reach the
            port can read, without authentication.
        prog_bar: show ``memopt/peak_allocated_gb`` on the progress bar.

    Raises:
        MisconfigurationException: for ``every_n_steps`` < 1, a port outside 1–65535, a value of the
            wrong type (``every_n_steps="abc"``, ``record_cuda_history="maybe"``), a
            ``prometheus_address`` that is no IP address or host name, or a ``prometheus_port``
            without ``prometheus_client`` installed.
        OSError: at fit start, when the Prometheus server cannot bind its address and port (in use),
            naming both.

    Example::

        >>> monitor = MemoryMonitor(every_n_steps=10)
        >>> monitor.every_n_steps, [monitor.samples(step) for step in (8, 9, 10, 19)]
        (10, [False, True, False, True])
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        report_dir: str | Path | None = None,
        record_cuda_history: bool = False,
        prometheus_port: int | None = None,
        prometheus_address: str = "127.0.0.1",
        prog_bar: bool = False,
    ) -> None:
        try:
            self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
            self.report_dir = Path(check_path("report_dir", report_dir)) if report_dir is not None else None
            self.record_cuda_history = check_bool("record_cuda_history", record_cuda_history)
            self.prometheus_port = check_optional_int("prometheus_port", prometheus_port, minimum=1, maximum=65535)
            self.prometheus_address = check_bind_address("prometheus_address", prometheus_address)
            self.prog_bar = check_bool("prog_bar", prog_bar)
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
        self._gauges: PrometheusGauges | None = None
        self._device = torch.device("cpu")
        self._step: int | None = None  # the logging step of the optimizer step running now
        self._sampled_step = -1
        self._sampled_first = False
        self._sampling = False
        self._warned_compiled = False
        self.last_tracked: MemoryTracker | None = None
        self.last_logged: dict[str, float] = {}
        self.last_logged_step: int | None = None

    def samples(self, step: int) -> bool:
        """Whether the optimizer step at logging step ``step`` is sampled (the first of a fit is, too)."""
        return (step + 1) % self.every_n_steps == 0

    # -- set-up and tear-down ------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # the module is still on the CPU in `setup`: the strategy moves it later
        self._device = trainer.strategy.root_device
        self._step, self._sampled_step, self._sampled_first, self._sampling = None, -1, False, False
        self._warned_compiled = False
        if self._device.type == "cuda" and self.record_cuda_history:
            record_cuda_memory_history(True)
        if self.prometheus_port is not None:
            self._start_prometheus(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop()

    def _stop(self) -> None:
        # called from teardown, and from on_exception (Lightning skips teardown hooks after an error)
        self._stop_tracking()
        self._sampling = False
        self._stop_prometheus()
        if self._device.type == "cuda" and self.record_cuda_history:
            record_cuda_memory_history(False)

    def _pause_tracking(self) -> None:
        if self.tracker is not None and self.tracker.active:
            self.tracker.__exit__(None, None, None)

    def _stop_tracking(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.last_tracked = self.tracker
            self.tracker = None

    # -- the sampled optimizer steps -----------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.sanity_checking:
            return
        step = logging_step(trainer)
        if step != self._step:  # the first batch of an optimizer step
            self._step = step
            self._sampling = not self._sampled_first or self.samples(step)
            if self._sampling:
                self._sampled_first = True
                self._sampled_step = step
        if not self._sampling or self._device.type == "cuda":
            return
        # off CUDA the figures come from a tracker that runs through the sampled step only
        if self.tracker is None:
            compiled = compiled_parts(pl_module)
            if compiled:
                self._sampling = False
                self._warn_compiled(compiled)
                return
            self.tracker = MemoryTracker.start_training_step(pl_module, trainer.optimizers, batch, record_timeline=True)
            return
        # the next micro-batch of the step
        self.tracker.track(tree_flatten(batch)[0], "inputs", op="batch")
        self.tracker.phase = "forward"
        self.tracker.__enter__()

    def _warn_compiled(self, compiled: list[str]) -> None:
        if self._warned_compiled:
            return
        self._warned_compiled = True
        rank_zero_warn(
            f"MemoryMonitor: skipping the CPU memory tracker: the model runs compiled code ({', '.join(compiled)}), "
            "and tracking a step would turn torch.compile off for the rest of the run. No memopt/* memory figures "
            "are logged on the CPU (on CUDA they come from the allocator and work with torch.compile)"
        )

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
        if trainer.sanity_checking or not self._sampling:
            return
        self._pause_tracking()  # between micro-batches (data loading) nothing is counted
        if not ends_optimizer_step(trainer, pl_module):
            return
        self._sampling = False
        if self._device.type != "cuda" and self.tracker is None:
            return
        if self.tracker is not None:
            for optimizer in trainer.optimizers:
                self.tracker.relabel_optimizer_state(optimizer)
        figures = self.read(self._device)
        self._stop_tracking()
        self._log(trainer, pl_module, figures, logging_step(trainer))

    # -- figures -------------------------------------------------------------------------------
    def read(self, device: torch.device) -> dict[str, float]:
        """The figures of the sampled step on ``device`` (the CUDA peak is reset afterwards)."""
        if device.type == "cuda":
            return cuda_figures(device)
        assert self.tracker is not None
        return tracker_figures(self.tracker)

    def _log(self, trainer: Trainer, pl_module: LightningModule, figures: dict[str, float], step: int) -> None:
        names = list(figures)
        logged: dict[str, float] = {f"memopt/{name}": value for name, value in figures.items()}
        if trainer.world_size > 1:
            values = torch.tensor([figures[n] for n in names], dtype=torch.float64, device=pl_module.device)
            gathered = torch.as_tensor(pl_module.all_gather(values)).reshape(trainer.world_size, len(names))
            for column, name in enumerate(names):
                per_rank = gathered[:, column].tolist()
                logged[f"memopt/{name}_min"] = min(per_rank)
                logged[f"memopt/{name}_max"] = max(per_rank)
                logged.update({f"memopt/{name}_rank{rank}": value for rank, value in enumerate(per_rank)})
        self.last_logged, self.last_logged_step = logged, step
        if trainer.is_global_zero:
            # straight to the loggers at the batch's logging step, like LearningRateMonitor: `self.log` would
            # repeat the value, stale, at every later step Lightning logs until the next sample
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=step)
        # into trainer.callback_metrics (ModelCheckpoint, EarlyStopping) and the progress bar, not the loggers
        # (`on_train_batch_end` is a hook Lightning lets callbacks `log` from, `on_step` only)
        headline = "memopt/peak_allocated_gb"
        pl_module.log(headline, logged[headline], on_step=True, on_epoch=False, logger=False, prog_bar=self.prog_bar)
        others = {key: value for key, value in logged.items() if key != headline}
        pl_module.log_dict(others, on_step=True, on_epoch=False, logger=False)
        if self._gauges is not None:
            self._gauges.set(figures)

    # -- Prometheus ----------------------------------------------------------------------------
    def _start_prometheus(self, trainer: Trainer) -> None:
        assert self.prometheus_port is not None
        self._stop_prometheus()  # a fit that ended without teardown (interrupted) left it open
        port = self.prometheus_port + trainer.local_rank
        names = CUDA_FIGURES if self._device.type == "cuda" else CPU_FIGURES
        try:
            self._gauges = PrometheusGauges(names, self.prometheus_address, port)
        except OSError as error:
            raise OSError(
                f"MemoryMonitor: cannot serve the Prometheus gauges on {self.prometheus_address}:{port} "
                f"(`prometheus_address`, `prometheus_port` {self.prometheus_port} + local rank "
                f"{trainer.local_rank}): {error}"
            ) from error
        rank_zero_info(f"MemoryMonitor: Prometheus gauges at {self._gauges.url}")

    def _stop_prometheus(self) -> None:
        if self._gauges is not None:
            self._gauges.close()
        self._gauges = None

    # -- out of memory -------------------------------------------------------------------------
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        try:
            if is_oom_error(exception):
                directory = self.report_dir or Path(trainer.default_root_dir) / "memopt"
                directory.mkdir(parents=True, exist_ok=True)
                title = f"out of memory at step {trainer.global_step}"
                written = self.write_oom_report(directory, self._device, title, devices=trainer.num_devices)
                rank_zero_info(f"MemoryMonitor: out of memory; wrote {', '.join(str(p) for p in written)}")
        finally:
            self._stop()

    def write_oom_report(
        self, directory: Path, device: torch.device, title: str, devices: int | None = None
    ) -> list[Path]:
        """Write the OOM files for ``device`` into ``directory`` (``devices``: how many the run has, for the advice);
        returns the paths written."""
        if device.type != "cuda" and self.tracker is None and self.last_tracked is not None:
            # the failing step was not sampled: describe the last one that was
            title += f" (memory of the last sampled step, {self._sampled_step}; the failing step was not tracked)"
        return write_oom_files(directory, device, self.tracker or self.last_tracked, title, devices)
