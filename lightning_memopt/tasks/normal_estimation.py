"""LightningModule for surface-normal estimation: a Sapiens network, cosine + L1 loss, angular-error metrics.

The loss and the metrics compare at the label resolution: the head's raw prediction is upsampled
bilinearly to the size of the ground-truth normal map, then normalised to unit length
(:mod:`lightning_memopt.tasks.normals`); the optimizer decays the learning rate layer by layer
(:mod:`lightning_memopt.tasks.common`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from typing_extensions import override

from lightning_memopt.arguments import check_float
from lightning_memopt.models import VisionTransformer
from lightning_memopt.tasks.checks import check_betas, check_network, check_optimisation
from lightning_memopt.tasks.common import (
    PRETRAINED_ARGUMENTS,
    ScheduleName,
    adamw,
    build_network,
    clip_sharded_root,
    layer_decay_param_groups,
    with_step_schedule,
)
from lightning_memopt.tasks.normals import (
    ANGLE_THRESHOLDS,
    AngularError,
    angular_error_degrees,
    normal_loss,
    resize_normals,
)

# the helpers' names, importable from here as before they moved
__all__ = [
    "ANGLE_THRESHOLDS",
    "AngularError",
    "NormalEstimationModule",
    "angular_error_degrees",
    "layer_decay_param_groups",
    "normal_loss",
    "resize_normals",
]


class NormalEstimationModule(LightningModule):
    """Fine-tune a Sapiens network for surface normals, as in the Sapiens reference training.

    Batches are dicts: ``image`` float ``[B, 3, H, W]``, ``normal`` unit vectors ``[B, 3, H, W]`` and
    ``mask`` bool ``[B, 1, H, W]``. Loss: ``cosine_weight · (1 − cos) + l1_weight · L1`` over valid
    pixels at the label resolution (see :func:`normal_loss`). AdamW with layer-wise lr decay (see
    :func:`layer_decay_param_groups`), linear warm-up then polynomial decay per optimizer step.
    Logs ``train/loss`` (and its ``cosine``/``l1`` parts), ``val/loss`` and, per validation epoch,
    ``val/mean_angle``, ``val/median_angle``, ``val/within_11.25``, ``val/within_22.5``, ``val/within_30``.

    Args:
        backbone: a Sapiens preset from :func:`lightning_memopt.models.list_models` (the whole
            network, ViT backbone plus normal head), e.g. ``"sapiens_2b"`` or ``"sapiens_tiny"``.
        backbone_options: keyword overrides for the preset (e.g. ``{"patch_size": 32}``).
        pretrained: an official checkpoint file of the whole network, loaded after construction
            (see :func:`lightning_memopt.models.official.load_pretrained`).
        pretrained_backbone: an official backbone-only checkpoint file (Sapiens MAE pre-training).
        pretrained_weights_only: read those files with ``torch.load(weights_only=True)``; ``False`` for a
            trusted file that pickles more than tensors.
        lr: peak learning rate of the top layer.
        betas: AdamW betas.
        weight_decay: AdamW weight decay (not on biases, norms, the position table).
        layer_decay: layer-wise learning-rate decay factor in (0, 1].
        warmup_steps: linear warm-up length in optimizer steps.
        schedule: ``"polynomial"``, ``"cosine"`` or ``"constant"`` after the warm-up.
        power: exponent of the polynomial decay (1: linear, as in the reference).
        cosine_weight: weight of the cosine-similarity loss.
        l1_weight: weight of the L1 loss.

    Raises:
        ValueError: for a preset without a ViT backbone, an argument out of range, an unknown
            ``schedule``, or ``pretrained_weights_only`` neither a bool nor a word such as ``"on"`` / ``"off"``.
        TypeError: a number that is no number (``lr="abc"``), options that are no mapping.
        FileNotFoundError: a ``pretrained`` / ``pretrained_backbone`` file that does not exist.

    Example::

        >>> module = NormalEstimationModule(backbone="sapiens_tiny")
        >>> batch = {"image": torch.randn(2, 3, 64, 48), "normal": F.normalize(torch.randn(2, 3, 64, 48), dim=1),
        ...          "mask": torch.ones(2, 1, 64, 48, dtype=torch.bool)}
        >>> module.training_step(batch, 0).shape
        torch.Size([])
    """

    # what memopt-train returns to a sweeper by default (`objective=auto`), and which way is better:
    # mean angular error in degrees over the validation pixels
    validation_objective = ("val/mean_angle", "min")

    def __init__(
        self,
        backbone: str = "sapiens_0.3b",
        backbone_options: Mapping[str, Any] | None = None,
        pretrained: str | None = None,
        pretrained_backbone: str | None = None,
        pretrained_weights_only: bool = True,
        lr: float = 5e-4,
        betas: Sequence[float] = (0.9, 0.999),
        weight_decay: float = 0.1,
        layer_decay: float = 0.85,
        warmup_steps: int = 400,
        schedule: ScheduleName = "polynomial",
        power: float = 1.0,
        cosine_weight: float = 1.0,
        l1_weight: float = 1.0,
    ) -> None:
        super().__init__()
        # Checked and put in their proper types before save_hyperparameters records them.
        backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only = check_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )
        lr, weight_decay, warmup_steps, schedule, power = check_optimisation(
            lr, weight_decay, warmup_steps, schedule, power
        )
        betas = check_betas(betas)
        layer_decay = check_float("layer_decay", layer_decay, minimum=0, open_minimum=True, maximum=1)
        cosine_weight = check_float("cosine_weight", cosine_weight, minimum=0)
        l1_weight = check_float("l1_weight", l1_weight, minimum=0)
        if cosine_weight + l1_weight == 0:
            raise ValueError("`cosine_weight` and `l1_weight` are both 0: the loss would be 0; give one a weight > 0")
        self.save_hyperparameters(ignore=list(PRETRAINED_ARGUMENTS))
        self.network = build_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )
        if not isinstance(getattr(self.network, "backbone", None), VisionTransformer):
            raise ValueError(
                f"`backbone`={backbone!r} is not a normal-estimation network with a ViT `backbone`;"
                " choose a Sapiens preset (sapiens_0.3b, sapiens_0.6b, sapiens_1b, sapiens_2b, sapiens_tiny)"
            )
        self.val_angular_error = AngularError()

    @override
    def forward(self, images: Tensor) -> Tensor:
        """Unit surface normals at the head's resolution (8× the token grid): the network's raw output, normalised."""
        return F.normalize(self.network(images), dim=1)

    def loss_terms(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(prediction at the label size, loss, cosine term, L1 term)`` of a batch, in fp32."""
        target = batch["normal"].float()
        prediction = resize_normals(self.network(batch["image"]).float(), target.shape[-2:])
        hp = self.hparams
        loss, cosine, l1 = normal_loss(prediction, target, batch["mask"], hp["cosine_weight"], hp["l1_weight"])
        return prediction, loss, cosine, l1

    @override
    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        _, loss, cosine, l1 = self.loss_terms(batch)
        batch_size = batch["image"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({"train/cosine_loss": cosine, "train/l1_loss": l1}, batch_size=batch_size)
        return loss

    @override
    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        prediction, loss, _, _ = self.loss_terms(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["image"].shape[0])
        self.val_angular_error.update(prediction, batch["normal"], batch["mask"])

    @override
    def on_validation_epoch_end(self) -> None:
        values = self.val_angular_error.compute()
        self.log_dict({f"val/{key}": value for key, value in values.items()}, sync_dist=True)
        self.val_angular_error.reset()

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp: Any = self.hparams
        groups = layer_decay_param_groups(self.network, hp.lr, hp.weight_decay, hp.layer_decay)
        return with_step_schedule(self, adamw(groups, hp))

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, except norm clipping under FSDP, which goes through the sharded root."""
        if gradient_clip_algorithm != "value" and gradient_clip_val and clip_sharded_root(self, gradient_clip_val):
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
