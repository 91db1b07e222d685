"""What the task modules share past their argument checks: the network from a preset, AdamW and its schedule.

Each task builds its network from a preset name and options, then loads the official checkpoint
files it was given; the files are where the run started, not part of the model, so they are not
saved as hyperparameters (:data:`PRETRAINED_ARGUMENTS`) and a checkpoint restores without them.

The schedules are per step: linear warm-up, then polynomial or cosine decay (:func:`warmup_decay`); a network
with a ViT backbone may decay its learning rate layer by layer (:func:`layer_decay_param_groups`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import LRSchedulerConfigType, OptimizerLRSchedulerConfig
from torch import nn

from lightning_memopt.arguments import check_float, check_int
from lightning_memopt.models import VisionTransformer, create_model
from lightning_memopt.models.official import apply_pretrained
from lightning_memopt.private_api import attached_trainer
from lightning_memopt.selection import WRAPPER_NAMES

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

    The schedule is :func:`~lightning_memopt.tasks.common.step_scheduler` of the module's
    ``warmup_steps``, ``schedule`` and ``power`` hyperparameters over the trainer's run.
    """
    hp: Any = module.hparams
    scheduler = step_scheduler(optimizer, module.trainer, hp.warmup_steps, hp.schedule, hp.power)
    return {"optimizer": optimizer, "lr_scheduler": scheduler}


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


def _unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def layer_decay_param_groups(
    network: nn.Module, lr: float, weight_decay: float, layer_decay: float
) -> list[dict[str, Any]]:
    """AdamW parameter groups with layer-wise learning-rate decay for a network with a ViT ``backbone``.

    As in the Sapiens / BEiT reference: with ``L`` blocks, a parameter at depth ``i`` gets
    ``lr · layer_decay^(L + 1 − i)``, where the patch embedding and the position table are depth 0,
    block ``k`` is depth ``k + 1`` and everything after the blocks (final norm, head) is depth
    ``L + 1``, at the full ``lr``. Biases, norm weights (every 1-D parameter) and the position table
    get no weight decay. Names inserted by FSDP, activation checkpointing or ``torch.compile``
    wrappers are ignored. Groups carry a ``name`` (``layer_<i>_decay`` / ``layer_<i>_no_decay``).

    Args:
        network: a module with a :class:`VisionTransformer` attribute ``backbone``.
        lr: the learning rate of the top layer.
        weight_decay: decoupled weight decay of the matrices.
        layer_decay: factor per layer of depth, in (0, 1].

    Example::

        >>> from lightning_memopt.models import create_model
        >>> groups = layer_decay_param_groups(create_model("sapiens_tiny"), lr=1.0, weight_decay=0.1, layer_decay=0.5)
        >>> [(g["name"], g["lr"], g["weight_decay"]) for g in groups][:3]
        [('layer_0_decay', 0.125, 0.1), ('layer_0_no_decay', 0.125, 0.0), ('layer_1_decay', 0.25, 0.1)]
    """
    backbone = cast(VisionTransformer, network.backbone)
    top = int(backbone.depth) + 1
    groups: dict[str, dict[str, Any]] = {}
    for raw_name, parameter in network.named_parameters():
        if not parameter.requires_grad:
            continue
        name = _unwrapped_name(raw_name)
        layer = backbone.layer_id(name.removeprefix("backbone.")) if name.startswith("backbone.") else top
        decay = parameter.ndim > 1 and not name.endswith("pos_embed")
        key = f"layer_{layer}_{'decay' if decay else 'no_decay'}"
        if key not in groups:
            groups[key] = {
                "name": key,
                "params": [],
                "lr": lr * layer_decay ** (top - layer),
                "weight_decay": weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(parameter)
    return sorted(groups.values(), key=lambda group: (int(group["name"].split("_")[1]), group["name"]))
