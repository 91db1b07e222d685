"""A callback with a fault of its own, for the tests: a ValueError that names no argument, mid-fit."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class FaultAtFirstBatch(Callback):
    """Raise a ValueError like a shape mismatch in a training step, at the first training batch."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        raise ValueError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")
