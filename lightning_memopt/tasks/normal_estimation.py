"""LightningModule for surface-normal estimation: a Sapiens network, cosine + L1 loss, angular-error metrics.

The loss and the metrics compare at the label resolution: the head's raw prediction is upsampled
bilinearly to the size of the ground-truth normal map, then normalised to unit length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torchmetrics import Metric
from typing_extensions import override

from lightning_memopt.arguments import check_float
from lightning_memopt.models import VisionTransformer, create_model
from lightning_memopt.models.official import apply_pretrained
from lightning_memopt.tasks.checks import (
    check_backbone,
    check_betas,
    check_optimisation,
    check_options,
    check_pretrained,
)
from lightning_memopt.tasks.lr_schedule import ScheduleName, clip_sharded_root, step_scheduler

ANGLE_THRESHOLDS = (11.25, 22.5, 30.0)
# Path components that wrappers (FSDP, activation checkpointing, torch.compile) insert in parameter names.
_WRAPPER_NAME_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def resize_normals(normals: Tensor, size: Sequence[int]) -> Tensor:
    """Resize a normal map ``[B, 3, h, w]`` bilinearly to ``size = (H, W)`` and normalise it to unit length.

    Example::

        >>> normals = resize_normals(torch.tensor([[[[0.0]], [[0.0]], [[2.0]]]]), (2, 3))
        >>> normals.shape, normals[0, :, 1, 2].tolist()
        (torch.Size([1, 3, 2, 3]), [0.0, 0.0, 1.0])
    """
    if tuple(normals.shape[-2:]) != tuple(size):
        normals = F.interpolate(normals, size=tuple(size), mode="bilinear", align_corners=False)
    return F.normalize(normals, dim=1)


def normal_loss(
    prediction: Tensor, target: Tensor, mask: Tensor, cosine_weight: float = 1.0, l1_weight: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Cosine loss ``1 − cos(pred, target)`` plus L1 of the unit vectors, averaged over valid pixels.

    The L1 term is the mean over the three components of ``|pred − target|``. Pixels outside
    ``mask`` contribute nothing (not even NaN); with no valid pixel the loss is 0.

    Args:
        prediction: unit normals ``[B, 3, H, W]``.
        target: unit normals ``[B, 3, H, W]`` (any value outside the mask).
        mask: bool ``[B, 1, H, W]``, True where the target is valid.
        cosine_weight: weight of the cosine term.
        l1_weight: weight of the L1 term.

    Returns:
        ``(weighted total, cosine term, L1 term)``.

    Example::

        >>> up = torch.tensor([0.0, 0.0, 1.0]).view(1, 3, 1, 1).expand(1, 3, 2, 2)
        >>> mask = torch.tensor([[[[True, True], [False, False]]]])
        >>> [round(float(x), 4) for x in normal_loss(up, -up, mask)]
        [2.6667, 2.0, 0.6667]
    """
    valid = mask[:, 0]
    target = target.masked_fill(~mask, 0.0)
    count = valid.sum().clamp(min=1)
    cosine = torch.where(valid, 1.0 - (prediction * target).sum(dim=1), 0.0).sum() / count
    l1 = torch.where(valid, (prediction - target).abs().mean(dim=1), 0.0).sum() / count
    return cosine_weight * cosine + l1_weight * l1, cosine, l1


def angular_error_degrees(prediction: Tensor, target: Tensor) -> Tensor:
    """Angle in degrees between the normals of two maps ``[B, 3, H, W]``, per pixel ``[B, H, W]``.

    Computed as ``atan2(|p × t|, p · t)``, accurate for small angles too (unlike ``acos``).

    Example::

        >>> p = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
        >>> t = torch.tensor([1.0, 1.0, 0.0]).view(1, 3, 1, 1)
        >>> angular_error_degrees(p, t).flatten().tolist()
        [45.0]
    """
    cross = torch.linalg.cross(prediction, target, dim=1).norm(dim=1)
    return torch.rad2deg(torch.atan2(cross, (prediction * target).sum(dim=1)))


class AngularError(Metric):
    """Angular error of predicted normals over all valid pixels of a dataset (synchronised across ranks).

    ``compute()`` returns ``mean_angle`` and ``median_angle`` in degrees and ``within_<t>``, the
    percentage of pixels with an error below each threshold ``t``. Mean and percentages are exact;
    the median comes from a histogram of ``bin_width``-degree bins over [0, 180] (the bin centre:
    within ``bin_width / 2`` of the exact lower median, in constant memory).

    Args:
        thresholds: angles in degrees for the ``within_<t>`` percentages.
        bin_width: histogram resolution in degrees for the median.
        **kwargs: torchmetrics ``Metric`` options.

    Raises:
        ValueError: for a ``bin_width`` outside (0, 180] or a non-positive threshold.
        TypeError: a ``bin_width`` or threshold that is no number, ``thresholds`` that is no list.

    Example::

        >>> angles = torch.deg2rad(torch.tensor([0.0, 10.0, 20.0, 50.0]))
        >>> target = torch.stack([torch.zeros(4), angles.sin(), angles.cos()]).view(1, 3, 1, 4)
        >>> up = torch.tensor([0.0, 0.0, 1.0]).view(1, 3, 1, 1).expand(1, 3, 1, 4)
        >>> metric = AngularError()
        >>> metric.update(up, target, torch.ones(1, 1, 1, 4, dtype=torch.bool))
        >>> {key: round(float(value), 1) for key, value in metric.compute().items()}
        {'mean_angle': 20.0, 'median_angle': 10.0, 'within_11.25': 50.0, 'within_22.5': 75.0, 'within_30': 75.0}
    """

    full_state_update = False
    higher_is_better = False

    angle_sum: Tensor
    count: Tensor
    within: Tensor
    histogram: Tensor

    def __init__(self, thresholds: Sequence[float] = ANGLE_THRESHOLDS, bin_width: float = 0.01, **kwargs: Any) -> None:
        bin_width = check_float("bin_width", bin_width, minimum=0, open_minimum=True, maximum=180)  # degrees
        if isinstance(thresholds, str) or not isinstance(thresholds, Sequence) or not thresholds:
            raise TypeError(f"`thresholds` must be a non-empty list of angles in degrees, got {thresholds!r}")
        thresholds = tuple(check_float("thresholds", t, minimum=0, open_minimum=True) for t in thresholds)
        super().__init__(**kwargs)
        self.thresholds = thresholds
        self.bin_width = bin_width
        self.num_bins = math.ceil(180.0 / bin_width)
        self.add_state("angle_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("within", torch.zeros(len(self.thresholds), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("histogram", torch.zeros(self.num_bins, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, prediction: Tensor, target: Tensor, mask: Tensor) -> None:
        """Add the valid pixels of a batch: unit normals ``[B, 3, H, W]`` and a bool mask ``[B, 1, H, W]``."""
        angles = angular_error_degrees(prediction.float(), target.float())[mask[:, 0]]
        self.angle_sum += angles.sum(dtype=torch.float64)
        self.count += angles.numel()
        thresholds = torch.tensor(self.thresholds, device=angles.device)
        self.within += (angles[:, None] < thresholds).sum(dim=0)
        bins = (angles / self.bin_width).long().clamp_(0, self.num_bins - 1)
        self.histogram += torch.bincount(bins, minlength=self.num_bins)

    def compute(self) -> dict[str, Tensor]:
        count = self.count.clamp(min=1)
        lower_median_rank = (self.count - 1).clamp(min=0) // 2
        median_bin = torch.searchsorted(self.histogram.cumsum(0), lower_median_rank + 1)
        values = {
            "mean_angle": (self.angle_sum / count).float(),
            "median_angle": (median_bin.float() + 0.5) * self.bin_width,
        }
        for threshold, within in zip(self.thresholds, self.within, strict=True):
            values[f"within_{threshold:g}"] = 100.0 * within.float() / count
        return values


def _unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAME_PARTS)


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
        backbone = check_backbone(backbone)
        backbone_options = check_options("backbone_options", backbone_options)
        pretrained, pretrained_backbone, pretrained_weights_only = check_pretrained(
            pretrained, pretrained_backbone, pretrained_weights_only
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
        # The files are where the run started, not part of the model: a checkpoint restores without them.
        self.save_hyperparameters(ignore=["pretrained", "pretrained_backbone", "pretrained_weights_only"])
        self.network = create_model(backbone, **backbone_options)
        apply_pretrained(self.network, pretrained, pretrained_backbone, pretrained_weights_only)
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
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        scheduler = step_scheduler(optimizer, self.trainer, hp.warmup_steps, hp.schedule, hp.power)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

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
