"""TrainingSummary: steps, throughput, final loss and peak memory of a fit, printed at its end."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


@dataclass
class FitSummary:
    """What :class:`TrainingSummary` measured."""

    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    final_loss: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_source: str = ""

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    def format(self) -> str:
        """A short human-readable table."""
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        memory = "n/a" if self.peak_memory_bytes is None else f"{self.peak_memory_bytes / 2**30:.2f} GiB"
        return "\n".join(
            [
                "memopt-train summary",
                f"  optimizer steps   {self.steps}",
                f"  samples           {self.samples}",
                f"  samples/s         {self.samples_per_second:.1f}  (training batches only)",
                f"  final train loss  {loss}",
                f"  peak memory       {memory}  ({self.peak_memory_source})",
            ]
        )


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _process_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class TrainingSummary(Callback):
    """Measure a fit and print a summary at its end (rank 0).

    Time counts training batches only (forward, backward, optimizer), not validation or start-up.
    Peak memory is the CUDA allocator's peak on a GPU, else the process's peak resident set size.

    Args:
        loss_key: the logged metric reported as the final loss.

    Example::

        >>> summary = TrainingSummary()
        >>> summary.summary.steps
        0
    """

    def __init__(self, loss_key: str = "train/loss") -> None:
        self.loss_key = loss_key
        self.summary = FitSummary()
        self._batch_started = 0.0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.summary.train_seconds += time.perf_counter() - self._batch_started
        self.summary.samples += _batch_size(batch)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary.steps = trainer.global_step
        loss = trainer.callback_metrics.get(self.loss_key)
        self.summary.final_loss = None if loss is None else float(loss)
        if pl_module.device.type == "cuda":
            self.summary.peak_memory_bytes = torch.cuda.max_memory_allocated(pl_module.device)
            self.summary.peak_memory_source = "CUDA allocator peak"
        else:
            self.summary.peak_memory_bytes = _process_peak_rss_bytes()
            self.summary.peak_memory_source = "process peak RSS"
        rank_zero_info(self.summary.format())

    def as_dict(self) -> dict[str, Any]:
        """The measured figures as a plain dict (``samples_per_second`` included)."""
        return {**asdict(self.summary), "samples_per_second": self.summary.samples_per_second}
