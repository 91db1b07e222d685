"""TrainingSummary: steps, throughput, final loss and peak memory of a fit, logged (and printed) at its end."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_int, check_output_file
from lightning_memopt.batch_slicing import BatchSplitError, batch_size
from lightning_memopt.memory.compiled import compiled_parts
from lightning_memopt.memory.figures import mark_peak, peak_since_mark
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.private_api import logging_step, tree_flatten
from lightning_memopt.results_file import append_row
from lightning_memopt.vocabulary import format_bytes


@dataclass
class FitSummary:
    """What :class:`TrainingSummary` measured."""

    steps: int = 0
    samples: int = 0
    timed_samples: int = 0  # the samples of the timed batches (off CUDA the memory-counted batch is not timed)
    train_seconds: float = 0.0
    final_loss: float | None = None
    peak_memory_bytes: int | None = None  # tensor bytes: the CUDA allocator's peak, else the MemoryTracker's count
    peak_memory_source: str = ""
    peak_rss_bytes: int | None = None  # off CUDA where no batch was counted: the process's peak resident set size

    @property
    def samples_per_second(self) -> float:
        return self.timed_samples / self.train_seconds if self.train_seconds > 0 else 0.0

    def format(self) -> str:
        """A short human-readable table."""
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        memory = "n/a" if self.peak_memory_bytes is None else format_bytes(self.peak_memory_bytes, gib_from=0)
        if self.peak_rss_bytes is not None:
            memory = f"{format_bytes(self.peak_rss_bytes, gib_from=0)} resident"
        return "\n".join(
            [
                "memopt-train summary",
                f"  optimizer steps   {self.steps}",
                f"  samples           {self.samples}  (all ranks)",
                f"  samples/s         {self.samples_per_second:.1f}  (training loop, validation excluded)",
                f"  final train loss  {loss}",
                f"  peak memory       {memory}  ({self.peak_memory_source})",
            ]
        )


def _samples_in(batch: Any) -> int:
    """The samples of ``batch`` as micro-batching counts them, else its first tensor's first dimension (0: none)."""
    try:
        return batch_size(batch)
    except BatchSplitError:  # tensors of several lengths, a 0-d tensor, a type micro-batching was not taught
        first = next((item for item in tree_flatten(batch)[0] if isinstance(item, torch.Tensor)), None)
        return 0 if first is None else first.shape[0] if first.dim() else 1


_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _reset_process_peak_rss() -> bool:
    """Reset the process's peak resident set size (Linux); False where that is not possible."""
    try:
        _PROC_CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _process_peak_rss_bytes() -> int:
    """Peak resident set size: ``VmHWM`` (since the last reset) on Linux, else the lifetime peak."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# the figures logged at fit end, under memopt/summary/ (the others are text, or counted in these)
LOGGED_FIGURES = (
    "steps",
    "samples",
    "samples_per_second",
    "train_seconds",
    "final_loss",
    "peak_memory_bytes",
    "peak_rss_bytes",
)


class TrainingSummary(Callback):
    """Measure a fit and log its figures to the trainer's loggers at its end (rank 0); optionally print them.

    At fit end every logger gets ``memopt/summary/steps``, ``…/samples``, ``…/samples_per_second``,
    ``…/train_seconds``, ``…/final_loss`` and ``…/peak_memory_bytes`` or ``…/peak_rss_bytes`` (where known) in one
    ``log_metrics`` call, at the step Lightning's loggers reached (the number of optimizer steps);
    ``summary`` holds them, with ``peak_memory_source`` saying where the peak comes from.

    Time counts the training loop (data loading, forward, backward, optimizer, other callbacks), not
    validation or start-up; a CUDA device is synchronised only where timing starts and stops.
    Samples are counted over all ranks. Peak memory is the CUDA allocator's peak on a GPU (reset at
    fit start). Off CUDA it is the live tensor bytes of one training batch (``memory_batch``)
    counted by a :class:`~lightning_memopt.memory.MemoryTracker` — parameters, gradients,
    optimizer state, the batch and the step's tensors, the same every run — and that batch's time
    and samples are left out of the throughput; a fit that ends before that batch reports the
    process's peak resident set size instead, under its own key (``peak_rss_bytes``), and so does a model that
    runs code compiled by ``torch.compile`` (the tracker, a ``TorchDispatchMode``, would turn compilation off for
    the rest of the run: it is skipped, with one warning).

    Args:
        loss_key: the logged metric reported as the final loss.
        memory_batch: off CUDA, the training batch (0-based) whose memory is counted; the default 1
            is the first that starts with the optimizer state.
        csv_path: append the figures to this CSV file at fit end (rank 0), one row per fit; a sweep's
            jobs all write to one file, each row appended under a file lock
            (:func:`~lightning_memopt.results_file.append_row`), so concurrent jobs lose no row.
        label: the ``label`` column of that row (``memopt-train`` writes the job's overrides).
        print_summary: also print the summary table at fit end (rank 0); ``memopt-train`` does.

    Raises:
        MisconfigurationException: a negative ``memory_batch``, a ``csv_path`` that is a folder, or a
            value of the wrong type (``memory_batch="abc"``, ``print_summary="maybe"``).

    Example::

        >>> summary = TrainingSummary(print_summary=False)
        >>> summary.summary.steps, summary.print_summary
        (0, False)
    """

    def __init__(
        self,
        loss_key: str = "train/loss",
        memory_batch: int = 1,
        csv_path: str | Path | None = None,
        label: str = "",
        print_summary: bool = False,
    ) -> None:
        try:
            self.memory_batch = check_int("memory_batch", memory_batch)
            self.csv_path = None if csv_path is None else Path(check_output_file("csv_path", csv_path))
            self.print_summary = check_bool("print_summary", print_summary)
        except (TypeError, ValueError, OSError) as error:
            raise MisconfigurationException(f"TrainingSummary: {error}") from None
        if self.memory_batch < 0:
            raise MisconfigurationException(f"`memory_batch`={memory_batch!r} must be 0 or more")
        self.loss_key = str(loss_key)
        self.label = str(label)
        self.summary = FitSummary()
        self._stretch_started: float | None = None
        self._batches = 0
        self._tracker: MemoryTracker | None = None
        self._device = torch.device("cpu")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = FitSummary()
        self._stretch_started = None
        self._batches = 0
        # kept: at `on_fit_end` the strategy has already moved the module back to the CPU
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda":
            mark_peak(self._device)
            self.summary.peak_memory_source = "CUDA allocator peak"
        elif _reset_process_peak_rss():
            self.summary.peak_memory_source = "process peak RSS during the fit"
        else:
            self.summary.peak_memory_source = "process lifetime peak RSS"

    # Time runs from the first training batch after fit start (or after validation) to the next
    # validation or the end of training; the device is synchronised only at those boundaries, so the
    # training step itself gets no extra host sync.
    def _close_stretch(self) -> None:
        if self._stretch_started is None:
            return
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # count the kernels, not just their launch
        self.summary.train_seconds += time.perf_counter() - self._stretch_started
        self._stretch_started = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._device.type != "cuda" and self._batches == self.memory_batch and not self._skip_compiled(pl_module):
            self._close_stretch()  # the counted batch is slower: keep it out of the throughput
            self._tracker = MemoryTracker.start_training_step(pl_module, trainer.optimizers, batch)
            return
        if self._stretch_started is None:
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._stretch_started = time.perf_counter()

    def _skip_compiled(self, pl_module: LightningModule) -> bool:
        """Whether the counted batch is left uncounted because the model runs compiled code (warned once)."""
        compiled = compiled_parts(pl_module)
        if compiled:
            self.summary.peak_memory_source += " (MemoryTracker skipped: compiled model)"
            rank_zero_warn(
                f"TrainingSummary: not counting the memory of training batch {self.memory_batch} with a "
                f"MemoryTracker: the model runs compiled code ({', '.join(compiled)}), and tracking it would turn "
                "torch.compile off for the rest of the run. The peak memory reported is the process's peak RSS"
            )
        return bool(compiled)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        samples = _samples_in(batch) * trainer.world_size
        self.summary.samples += samples
        if self._tracker is not None:
            self._stop_tracking()
        else:
            self.summary.timed_samples += samples

    def _stop_tracking(self) -> None:
        if self._tracker is None:
            return
        self._tracker.close()
        self.summary.peak_memory_bytes = self._tracker.peak.total_bytes
        self.summary.peak_memory_source = f"live tensor bytes of training batch {self.memory_batch} (MemoryTracker)"
        self._tracker = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_tracking()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_stretch()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_stretch()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary.steps = trainer.global_step
        loss = trainer.callback_metrics.get(self.loss_key)
        self.summary.final_loss = None if loss is None else float(loss)
        if self._device.type == "cuda":
            self.summary.peak_memory_bytes = peak_since_mark(self._device)
        elif self.summary.peak_memory_bytes is None:  # the counted batch never ran, or was not tracked
            self.summary.peak_rss_bytes = _process_peak_rss_bytes()
        if trainer.is_global_zero:
            self._log(trainer)
            if self.print_summary:
                print(self.summary.format(), flush=True)
            if self.csv_path is not None:
                append_row(self.csv_path, {"label": self.label, **self.as_dict()})

    def _log(self, trainer: Trainer) -> None:
        figures = self.as_dict()
        metrics = {f"memopt/summary/{name}": figures[name] for name in LOGGED_FIGURES if figures[name] is not None}
        step = logging_step(trainer)  # after the last batch: its logging step + 1, the number of steps
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            logger.save()

    def as_dict(self) -> dict[str, Any]:
        """The measured figures as a plain dict (``samples_per_second`` included)."""
        return {**asdict(self.summary), "samples_per_second": self.summary.samples_per_second}
