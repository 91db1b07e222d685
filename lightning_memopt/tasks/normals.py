"""Surface normals compared: resizing to the label size, the cosine + L1 loss and the angular-error metric.

The loss and the metrics compare at the label resolution: a raw prediction is upsampled bilinearly
to the size of the ground-truth normal map, then normalised to unit length (:func:`resize_normals`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from lightning_memopt.arguments import check_float

ANGLE_THRESHOLDS = (11.25, 22.5, 30.0)


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
