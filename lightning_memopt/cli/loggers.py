"""End the logger runs that outlive a fit, so each job of a multirun logs a run of its own.

Lightning finalises its loggers at the end of ``fit`` but leaves a Weights & Biases run open (it is
a process-wide object that ``wandb`` finishes at exit). Under Hydra's basic launcher every job of a
sweep runs in one process, so without this every job would append to the first job's W&B run.

Example::

    >>> finish_logger_runs([])
    0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def finish_logger_runs(loggers: Iterable[Any], exit_code: int = 0) -> int:
    """Finish the W&B run a ``WandbLogger`` in ``loggers`` started (``wandb.finish``); returns how many (0 or 1).

    A later ``WandbLogger`` then starts a new run instead of attaching to the finished one.

    Args:
        loggers: the Trainer's loggers.
        exit_code: 0 for a fit that ended normally; anything else marks the W&B run failed.
    """
    from lightning.pytorch.loggers import WandbLogger

    if not any(isinstance(logger, WandbLogger) for logger in loggers):
        return 0
    import wandb

    if wandb.run is None:  # never started (another rank, or nothing logged)
        return 0
    wandb.finish(exit_code=exit_code)
    return 1
