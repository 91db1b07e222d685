"""A callback that presses Ctrl-C (sends this process SIGINT) after a given training step, for the tests."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class CtrlCAfterStep(Callback):
    """Send SIGINT to this process ``presses`` times at the end of training step ``step`` (its global step)."""

    def __init__(self, step: int, presses: int = 1) -> None:
        self.step = step
        self.presses = presses

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.presses):
                os.kill(os.getpid(), signal.SIGINT)
