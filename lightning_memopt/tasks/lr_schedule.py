"""Per-step learning-rate schedules (linear warm-up, then polynomial or cosine decay) and clipping helpers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfigType

from lightning_memopt.arguments import check_float, check_int
from lightning_memopt.private_api import attached_trainer

SCHEDULES = ("polynomial", "cosine", "constant")
ScheduleName = Literal["polynomial", "cosine", "constant"]  # == SCHEDULES


def check_schedule(schedule: object) -> str:
    """``schedule`` if it is one of :data:`SCHEDULES`.

    Raises:
        ValueError: naming the valid schedules.

    Example::

        >>> check_schedule("cosine")
        'cosine'
    """
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(f"Unknown `schedule`={schedule!r}; valid choices: {', '.join(SCHEDULES)}")
    return schedule


def warmup_decay(
    total_steps: int, warmup_steps: int = 0, schedule: ScheduleName = "polynomial", power: float = 2.0
) -> Callable[[int], float]:
    """Return ``step -> factor`` for :class:`torch.optim.lr_scheduler.LambdaLR`.

    The factor rises linearly from ``1/warmup_steps`` to 1 over the warm-up, then decays to 0 at
    ``total_steps`` as ``(1 − progress)^power`` (polynomial) or ``½(1 + cos(π·progress))`` (cosine).

    Raises:
        ValueError: for an unknown ``schedule``, ``warmup_steps`` outside ``[0, total_steps)`` or a ``power`` ≤ 0.
        TypeError: a step count or ``power`` that is no number.

    Example::

        >>> factor = warmup_decay(total_steps=10, warmup_steps=2, schedule="polynomial", power=1.0)
        >>> [round(factor(s), 3) for s in (0, 1, 2, 6, 10)]
        [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    schedule = check_schedule(schedule)
    total_steps = check_int("total_steps", total_steps, minimum=0)
    warmup_steps = check_int("warmup_steps", warmup_steps)
    if not 0 <= warmup_steps < max(total_steps, 1):
        raise ValueError(f"`warmup_steps`={warmup_steps!r} must be in [0, total_steps={total_steps})")
    power = check_float("power", power, minimum=0, open_minimum=True)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return (1.0 - progress) ** power

    return factor


def step_scheduler(
    optimizer: torch.optim.Optimizer, trainer: Any, warmup_steps: int, schedule: str, power: float
) -> LRSchedulerConfigType:
    """Lightning's ``lr_scheduler`` entry: :func:`warmup_decay` over the run's optimizer steps, per step.

    Raises:
        ValueError: when the run has no end (``max_steps`` and ``max_epochs`` both -1).
    """
    total_steps = trainer.estimated_stepping_batches
    if not math.isfinite(total_steps):
        raise ValueError(
            "the learning-rate schedule needs a finite run: set `trainer.max_steps` or `trainer.max_epochs` "
            f"(got max_steps={trainer.max_steps!r}, max_epochs={trainer.max_epochs!r})"
        )
    factor = warmup_decay(int(total_steps), warmup_steps, schedule, power)
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}


def clip_sharded_root(module: Any, max_norm: float) -> bool:
    """Clip by norm through an FSDP root's own ``clip_grad_norm_`` (the only norm that spans every shard).

    Returns:
        Whether ``module`` runs under such a root (and was clipped); False leaves clipping to the caller.
    """
    sharded_root = getattr(getattr(attached_trainer(module), "strategy", None), "model", None)
    clip = getattr(sharded_root, "clip_grad_norm_", None)
    if not callable(clip):
        return False
    clip(max_norm)
    return True
