"""The tracking losses of every window and refinement iteration, and TAP-Vid's metrics of the final tracks.

Inputs are a tracker's :class:`~lightning_memopt.models.TrackerOutput` and a batch of dicts (see
:mod:`lightning_memopt.data.tracking_sample`). Losses count only frames at or after each track's
query frame; the metrics only frames after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_memopt.models import TrackerOutput

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
