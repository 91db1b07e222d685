"""LightningModule for point tracking (CoTracker2 / CoTracker3 online, offline).

Batches are dicts (see :mod:`lightning_memopt.data.tracking_sample`): ``video`` float [B, T, 3, H, W]
in [0, 255], ``tracks`` float [B, T, N, 2] in pixels, ``visibility`` bool [B, T, N] and ``queries``
float [B, N, 3] of ``(t, x, y)``. The losses and TAP-Vid metrics are those of
:mod:`lightning_memopt.tasks.tracking_losses`; losses count only frames at or after each track's query frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from typing_extensions import override

from lightning_memopt.arguments import check_float
from lightning_memopt.models import TrackerOutput
from lightning_memopt.tasks.checks import check_betas, check_network, check_optimisation
from lightning_memopt.tasks.common import PRETRAINED_ARGUMENTS, ScheduleName, adamw, build_network, with_step_schedule
from lightning_memopt.tasks.tracking_losses import (
    DELTA_THRESHOLDS,
    METRIC_RESOLUTION,
    WindowTargets,
    discounted_mean,
    tracking_losses,
    tracking_metrics,
    window_targets,
)

# the helpers' names, importable from here as before they moved
__all__ = [
    "DELTA_THRESHOLDS",
    "METRIC_RESOLUTION",
    "TrackingModule",
    "WindowTargets",
    "discounted_mean",
    "tracking_losses",
    "tracking_metrics",
    "window_targets",
]


class TrackingModule(LightningModule):
    """Train a CoTracker preset on dict batches of clips, tracks, visibility and queries.

    Loss: ``track + visibility_weight · visibility + confidence_weight · confidence`` (see
    :func:`tracking_losses`). Logs ``train/loss`` and its parts; in validation ``val/loss``,
    ``val/delta_avg`` and ``val/occlusion_acc`` (see :func:`tracking_metrics`; a point is predicted
    visible when its visibility logit is positive).

    Args:
        backbone: a tracker preset from :func:`lightning_memopt.models.list_models` (``"cotracker2"``,
            ``"cotracker3"``, ``"cotracker3_offline"`` (one window of the whole clip), ``"cotracker2_tiny"``,
            ``"cotracker3_tiny"``, ``"cotracker3_offline_tiny"``).
        backbone_options: keyword overrides for the preset (``window_len``, ``iters``, ``corr_radius``,
            ``corr_levels``, ``model_resolution``, ``attn_impl`` …).
        pretrained: an official checkpoint file of the whole network, loaded after construction
            (see :func:`lightning_memopt.models.official.load_pretrained`).
        pretrained_backbone: an official backbone-only checkpoint file (Sapiens MAE pre-training).
        pretrained_weights_only: read those files with ``torch.load(weights_only=True)``; ``False`` for a
            trusted file that pickles more than tensors.
        gamma: discount of earlier refinement iterations, in (0, 1].
        huber_delta: Huber threshold of the track loss, in pixels.
        visibility_weight: weight of the visibility loss.
        confidence_weight: weight of the confidence loss (CoTracker3).
        confidence_threshold: distance in pixels within which a prediction counts as confident.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up length in optimizer steps.
        schedule: ``"polynomial"``, ``"cosine"`` or ``"constant"`` after the warm-up.
        power: exponent of the polynomial decay.

    Raises:
        ValueError: for an argument out of range, an unknown preset or schedule, or
            ``pretrained_weights_only`` neither a bool nor a word such as ``"on"`` / ``"off"``.
        TypeError: a number that is no number (``gamma="abc"``), options that are no mapping.
        FileNotFoundError: a ``pretrained`` / ``pretrained_backbone`` file that does not exist.

    Example::

        >>> module = TrackingModule(backbone="cotracker3_tiny")
        >>> batch = {"video": torch.rand(1, 4, 3, 64, 64) * 255, "tracks": torch.rand(1, 4, 3, 2) * 63,
        ...          "visibility": torch.ones(1, 4, 3, dtype=torch.bool), "queries": torch.zeros(1, 3, 3)}
        >>> losses, output = module.losses(batch)
        >>> sorted(losses), output.tracks.shape
        (['confidence_loss', 'loss', 'track_loss', 'visibility_loss'], torch.Size([1, 4, 3, 2]))
    """

    # what memopt-train returns to a sweeper by default (`objective=auto`), and which way is better:
    # mean fraction of visible points tracked within the TAP-Vid thresholds
    validation_objective = ("val/delta_avg", "max")

    def __init__(
        self,
        backbone: str = "cotracker2",
        backbone_options: Mapping[str, Any] | None = None,
        pretrained: str | None = None,
        pretrained_backbone: str | None = None,
        pretrained_weights_only: bool = True,
        gamma: float = 0.8,
        huber_delta: float = 6.0,
        visibility_weight: float = 1.0,
        confidence_weight: float = 1.0,
        confidence_threshold: float = 12.0,
        lr: float = 5e-4,
        weight_decay: float = 1e-5,
        betas: Sequence[float] = (0.9, 0.999),
        warmup_steps: int = 0,
        schedule: ScheduleName = "cosine",
        power: float = 2.0,
    ) -> None:
        super().__init__()
        # Checked and put in their proper types before save_hyperparameters records them.
        backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only = check_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )
        gamma = check_float("gamma", gamma, minimum=0, open_minimum=True, maximum=1)
        huber_delta = check_float("huber_delta", huber_delta, minimum=0, open_minimum=True)  # pixels
        confidence_threshold = check_float("confidence_threshold", confidence_threshold, minimum=0, open_minimum=True)
        visibility_weight = check_float("visibility_weight", visibility_weight, minimum=0)
        confidence_weight = check_float("confidence_weight", confidence_weight, minimum=0)
        lr, weight_decay, warmup_steps, schedule, power = check_optimisation(
            lr, weight_decay, warmup_steps, schedule, power
        )
        betas = check_betas(betas)
        self.save_hyperparameters(ignore=list(PRETRAINED_ARGUMENTS))
        self.backbone = build_network(
            backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only
        )

    @override
    def forward(self, video: Tensor, queries: Tensor) -> TrackerOutput:
        """Track ``queries`` [B, N, 3] through ``video`` [B, T, 3, H, W] in [0, 255]."""
        return self.backbone(video, queries)

    def losses(self, batch: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], TrackerOutput]:
        """The weighted total (``"loss"``), its parts and the tracker's output for a batch."""
        hp: Any = self.hparams
        output = self(batch["video"], batch["queries"])
        parts = tracking_losses(output, batch, hp.gamma, hp.huber_delta, hp.confidence_threshold)
        weights = {"track": 1.0, "visibility": hp.visibility_weight, "confidence": hp.confidence_weight}
        total = sum((weights[name] * value for name, value in parts.items()), torch.zeros((), device=self.device))
        return {"loss": total, **{f"{name}_loss": value for name, value in parts.items()}}, output

    @override
    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        losses, _ = self.losses(batch)
        batch_size = batch["video"].shape[0]
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=batch_size)
        for name, value in losses.items():
            if name != "loss":
                self.log(f"train/{name}", value, batch_size=batch_size)
        return losses["loss"]

    @override
    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        losses, output = self.losses(batch)
        metrics = tracking_metrics(
            output.tracks,
            output.visibility > 0,
            batch["tracks"],
            batch["visibility"],
            batch["queries"][..., 0].round(),
            batch["video"].shape[-2:],
        )
        batch_size = batch["video"].shape[0]
        self.log("val/loss", losses["loss"], prog_bar=True, sync_dist=True, batch_size=batch_size)
        for name, value in metrics.items():
            self.log(f"val/{name}", value, sync_dist=True, batch_size=batch_size)

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        return with_step_schedule(self, adamw(self.parameters(), self.hparams))
