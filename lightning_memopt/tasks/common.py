"""What the task modules share past their argument checks: the network from a preset, AdamW and its schedule.

Each task builds its network from a preset name and options, then loads the official checkpoint
files it was given; the files are where the run started, not part of the model, so they are not
saved as hyperparameters (:data:`PRETRAINED_ARGUMENTS`) and a checkpoint restores without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn

from lightning_memopt.models import create_model
from lightning_memopt.models.official import apply_pretrained
from lightning_memopt.tasks.lr_schedule import step_scheduler

# The constructor arguments naming official checkpoint files: left out of the saved hyperparameters.
PRETRAINED_ARGUMENTS = ("pretrained", "pretrained_backbone", "pretrained_weights_only")


def build_network(
    backbone: str,
    options: Mapping[str, Any],
    pretrained: str | None,
    pretrained_backbone: str | None,
    weights_only: bool,
) -> nn.Module:
    """The preset ``backbone`` built with ``options``, then loaded from the official files given (if any).

    See :func:`~lightning_memopt.models.create_model` and :func:`~lightning_memopt.models.official.apply_pretrained`.

    Example::

        >>> type(build_network("iresnet_tiny", {}, None, None, True)).__name__
        'IResNet'
    """
    network = create_model(backbone, **options)
    apply_pretrained(network, pretrained, pretrained_backbone, weights_only)
    return network


def adamw(parameters: Iterable[Any], hparams: Any) -> torch.optim.AdamW:
    """AdamW over ``parameters`` (tensors or groups) with the task's ``lr``, ``betas`` and ``weight_decay``.

    Example::

        >>> from types import SimpleNamespace
        >>> hp = SimpleNamespace(lr=0.1, betas=[0.9, 0.99], weight_decay=0.0)
        >>> adamw([torch.zeros(1, requires_grad=True)], hp).defaults["betas"]
        (0.9, 0.99)
    """
    return torch.optim.AdamW(parameters, lr=hparams.lr, betas=tuple(hparams.betas), weight_decay=hparams.weight_decay)


def with_step_schedule(module: LightningModule, optimizer: torch.optim.Optimizer) -> OptimizerLRSchedulerConfig:
    """``configure_optimizers``' answer: ``optimizer`` and the module's warm-up and decay, stepped per optimizer step.

    The schedule is :func:`~lightning_memopt.tasks.lr_schedule.step_scheduler` of the module's
    ``warmup_steps``, ``schedule`` and ``power`` hyperparameters over the trainer's run.
    """
    hp: Any = module.hparams
    scheduler = step_scheduler(optimizer, module.trainer, hp.warmup_steps, hp.schedule, hp.power)
    return {"optimizer": optimizer, "lr_scheduler": scheduler}
