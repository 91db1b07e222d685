"""LightningModule for point tracking (CoTracker2 / CoTracker3 online, offline), its losses and TAP-Vid metrics.

Batches are dicts (see :mod:`lightning_memopt.data.tracking_sample`): ``video`` float [B, T, 3, H, W]
in [0, 255], ``tracks`` float [B, T, N, 2] in pixels, ``visibility`` bool [B, T, N] and ``queries``
float [B, N, 3] of ``(t, x, y)``. Losses count only frames at or after each track's query frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor
from typing_extensions import override

from lightning_memopt.arguments import check_float
from lightning_memopt.models import TrackerOutput, create_model
from lightning_memopt.models.official import apply_pretrained
from lightning_memopt.tasks.checks import (
    check_backbone,
    check_betas,
    check_optimisation,
    check_options,
    check_pretrained,
)
from lightning_memopt.tasks.lr_schedule import ScheduleName, step_scheduler

DELTA_THRESHOLDS = (1.0, 2.0, 4.0, 8.0, 16.0)  # pixels, at a 256 × 256 scale as in TAP-Vid
METRIC_RESOLUTION = 256.0


class WindowTargets(NamedTuple):
    """Ground truth laid out like a tracker's window outputs: tracks [W, B, S, N, 2], visible, counted [W, B, S, N]."""

    tracks: Tensor
    visible: Tensor
    counted: Tensor


def window_targets(output: TrackerOutput, batch: Mapping[str, Tensor]) -> WindowTargets:
    """Gather the ground truth of every window position; ``counted`` is False on padding frames and
    on frames before a track's query frame.

    Example::

        >>> output = TrackerOutput(torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1), None, torch.zeros(2, 1, 1, 2, 1, 2),
        ...                        torch.zeros(2, 1, 1, 2, 1), None, window_starts=(0, 1), num_frames=3)
        >>> batch = {"tracks": torch.arange(6.0).view(1, 3, 1, 2), "visibility": torch.ones(1, 3, 1, dtype=torch.bool),
        ...          "queries": torch.tensor([[[1.0, 2.0, 3.0]]])}
        >>> window_targets(output, batch).counted[:, 0, :, 0].tolist()
        [[False, True], [True, True]]
    """
    frames = output.window_frames()  # W S
    index = frames.clamp(max=output.num_frames - 1)
    tracks = batch["tracks"][:, index].transpose(0, 1)  # B W S N 2 -> W B S N 2
    visible = batch["visibility"][:, index].transpose(0, 1)
    query_frames = batch["queries"][..., 0].round().long()  # B N
    after_query = frames[:, None, :, None] >= query_frames[None, :, None, :]  # W B S N
    counted = after_query & (frames < output.num_frames)[:, None, :, None]
    return WindowTargets(tracks, visible, counted)


def discounted_mean(values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``Σᵢ γ^(I−1−i) · (mean of values[:, i] where mask)``, averaged over windows.

    Args:
        values: [W, I, B, S, N] per-iteration losses.
        mask: [W, B, S, N] bool, where the losses count.
        gamma: discount of earlier iterations (the last iteration weighs 1).

    Example::

        >>> values = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1, 1)
        >>> discounted_mean(values, torch.ones(1, 1, 1, 1, dtype=torch.bool), gamma=0.5).item()
        2.5
    """
    iterations = values.shape[1]
    weights = gamma ** torch.arange(iterations - 1, -1, -1, device=values.device, dtype=values.dtype)
    weight = mask[:, None].to(values.dtype)
    per_iteration = (values * weight).sum(dim=(2, 3, 4)) / weight.sum(dim=(2, 3, 4)).clamp(min=1.0)  # W I
    return (per_iteration * weights).sum(dim=1).mean()


def tracking_losses(
    output: TrackerOutput,
    batch: Mapping[str, Tensor],
    gamma: float = 0.8,
    huber_delta: float = 6.0,
    confidence_threshold: float = 12.0,
) -> dict[str, Tensor]:
    """The losses of every window and iteration, discounted by ``gamma`` over iterations.

    - ``track``: Huber loss (mean over x and y, in pixels of the input video) over visible points;
    - ``visibility``: binary cross-entropy of the visibility logits against the visibility;
    - ``confidence`` (CoTracker3 only): binary cross-entropy of the confidence logits against
      "within ``confidence_threshold`` pixels of the truth" (positions detached), over visible points.

    Example::

        >>> output = TrackerOutput(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1), None, torch.zeros(1, 1, 1, 2, 1, 2),
        ...                        torch.zeros(1, 1, 1, 2, 1), None, window_starts=(0,), num_frames=2)
        >>> batch = {"tracks": torch.ones(1, 2, 1, 2), "visibility": torch.ones(1, 2, 1, dtype=torch.bool),
        ...          "queries": torch.tensor([[[0.0, 1.0, 1.0]]])}
        >>> {name: round(value.item(), 4) for name, value in tracking_losses(output, batch).items()}
        {'track': 0.5, 'visibility': 0.6931}
    """
    targets = window_targets(output, batch)
    true_tracks = targets.tracks[:, None].expand_as(output.window_tracks)
    huber = F.huber_loss(output.window_tracks, true_tracks, reduction="none", delta=huber_delta).mean(dim=-1)
    visible_counted = targets.visible & targets.counted
    visibility_target = targets.visible[:, None].expand_as(output.window_visibility).to(output.window_visibility.dtype)
    visibility_bce = F.binary_cross_entropy_with_logits(output.window_visibility, visibility_target, reduction="none")
    losses = {
        "track": discounted_mean(huber, visible_counted, gamma),
        "visibility": discounted_mean(visibility_bce, targets.counted, gamma),
    }
    if output.window_confidence is not None:
        error = (output.window_tracks.detach() - true_tracks).norm(dim=-1)
        confident = (error <= confidence_threshold).to(output.window_confidence.dtype)
        confidence_bce = F.binary_cross_entropy_with_logits(output.window_confidence, confident, reduction="none")
        losses["confidence"] = discounted_mean(confidence_bce, visible_counted, gamma)
    return losses


def tracking_metrics(
    tracks: Tensor,
    visible: Tensor,
    true_tracks: Tensor,
    true_visible: Tensor,
    query_frames: Tensor,
    image_size: Sequence[int],
) -> dict[str, Tensor]:
    """TAP-Vid's position accuracy δ_avg and occlusion accuracy, over the frames after each query frame.

    δ_avg is the mean over thresholds {1, 2, 4, 8, 16} px, with positions rescaled to 256 × 256, of
    the fraction of truly visible points predicted closer than the threshold. Occlusion accuracy is
    the fraction of points whose predicted visibility is right.

    Args:
        tracks: [B, T, N, 2] predicted positions in pixels of an ``image_size`` video.
        visible: [B, T, N] bool predicted visibility.
        true_tracks: [B, T, N, 2]; true_visible: [B, T, N] bool; query_frames: [B, N].
        image_size: ``(H, W)`` of the video.

    Example::

        >>> truth = torch.zeros(1, 3, 1, 2)
        >>> prediction = truth + torch.tensor([0.0, 3.0]).view(1, 1, 1, 2)  # 3 px off at 256 × 256
        >>> shown = torch.ones(1, 3, 1, dtype=torch.bool)
        >>> metrics = tracking_metrics(prediction, shown, truth, shown, torch.zeros(1, 1), (256, 256))
        >>> round(metrics["delta_avg"].item(), 2), metrics["occlusion_acc"].item()
        (0.6, 1.0)
    """
    num_frames = tracks.shape[1]
    evaluated = torch.arange(num_frames, device=tracks.device)[None, :, None] > query_frames[:, None, :]
    height, width = image_size
    scale = torch.tensor([METRIC_RESOLUTION / width, METRIC_RESOLUTION / height], device=tracks.device)
    error = ((tracks.float() - true_tracks.float()) * scale).norm(dim=-1)
    counted = (true_visible & evaluated).float()
    within = torch.stack([(error < threshold).float() * counted for threshold in DELTA_THRESHOLDS])
    delta_avg = within.sum(dim=(1, 2, 3)).mean() / counted.sum().clamp(min=1.0)
    correct = ((visible == true_visible) & evaluated).float()
    return {"delta_avg": delta_avg, "occlusion_acc": correct.sum() / evaluated.float().sum().clamp(min=1.0)}


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
        backbone = check_backbone(backbone)
        backbone_options = check_options("backbone_options", backbone_options)
        pretrained, pretrained_backbone, pretrained_weights_only = check_pretrained(
            pretrained, pretrained_backbone, pretrained_weights_only
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
        # The files are where the run started, not part of the model: a checkpoint restores without them.
        self.save_hyperparameters(ignore=["pretrained", "pretrained_backbone", "pretrained_weights_only"])
        self.backbone = create_model(backbone, **backbone_options)
        apply_pretrained(self.backbone, pretrained, pretrained_backbone, pretrained_weights_only)

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
        hp: Any = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        scheduler = step_scheduler(optimizer, self.trainer, hp.warmup_steps, hp.schedule, hp.power)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
