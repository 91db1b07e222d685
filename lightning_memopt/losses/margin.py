"""Combined angular-margin softmax loss: ArcFace, CosFace and SphereFace in one formula."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REDUCTIONS = ("mean", "none")
Reduction = Literal["mean", "none"]  # == REDUCTIONS
_COS_CLAMP = 1.0 - 1e-7


def _validate_margins(margin_list: Sequence[float], scale: float) -> tuple[float, float, float]:
    try:
        m1, m2, m3 = (float(m) for m in margin_list)
    except (TypeError, ValueError):
        raise ValueError(
            f"`margin_list` must be three numbers (m1, m2, m3), e.g. (1.0, 0.5, 0.0) for ArcFace or "
            f"(1.0, 0.0, 0.4) for CosFace; got {margin_list!r}"
        ) from None
    if m1 < 1.0 or m2 < 0.0 or m3 < 0.0:
        raise ValueError(
            f"`margin_list`={tuple(margin_list)!r} needs m1 >= 1, m2 >= 0 and m3 >= 0 "
            "(target logit cos θ → cos(m1·θ + m2) − m3)"
        )
    if not scale > 0:
        raise ValueError(f"`scale`={scale!r} must be positive (64 in the reference training)")
    return m1, m2, m3


class CombinedMarginLoss(nn.Module):
    """Softmax cross-entropy over ``scale · cos`` with the target logit cos θ → cos(m1·θ + m2) − m3.

    ``(1, 0.5, 0)`` is ArcFace, ``(1, 0, 0.4)`` CosFace and ``m1 > 1`` a SphereFace-style
    multiplicative margin. Where ``m1·θ + m2`` passes π the target logit continues with SphereFace's
    monotonic extension ``(−1)^k cos(φ) − 2k`` (``k = ⌊φ/π⌋``) so it keeps falling as θ grows.
    The loss is computed in fp32 with autocast disabled, whatever the surrounding precision.

    Args:
        margin_list: ``(m1, m2, m3)``.
        scale: the logit scale ``s``.

    Raises:
        ValueError: for a malformed ``margin_list`` or a non-positive ``scale``.

    Example::

        >>> loss_fn = CombinedMarginLoss((1.0, 0.5, 0.0), scale=64.0)
        >>> cosine = torch.tensor([[0.9, 0.1], [0.2, 0.3]])
        >>> loss_fn.margin_logits(cosine, torch.tensor([0, 1]))[0, 0] / 64  # cos(acos(0.9) + 0.5)
        tensor(0.5808)
        >>> loss_fn(cosine, torch.tensor([0, 1])).shape
        torch.Size([])
    """

    def __init__(self, margin_list: Sequence[float] = (1.0, 0.5, 0.0), scale: float = 64.0) -> None:
        super().__init__()
        self.m1, self.m2, self.m3 = _validate_margins(margin_list, scale)
        self.scale = float(scale)

    def target_logit(self, cosine: Tensor) -> Tensor:
        """Apply the margin to target cosines (any shape), before scaling."""
        if self.m1 == 1.0 and self.m2 == 0.0:
            return cosine - self.m3
        theta = torch.acos(cosine.clamp(-_COS_CLAMP, _COS_CLAMP))
        phi = self.m1 * theta + self.m2
        k = torch.floor(phi / math.pi).detach()
        sign = 1.0 - 2.0 * torch.remainder(k, 2.0)
        return sign * torch.cos(phi) - 2.0 * k - self.m3

    def margin_logits(self, cosine: Tensor, labels: Tensor) -> Tensor:
        """Scaled logits ``s · cos`` with the margin applied at each row's ``labels`` column."""
        rows = torch.arange(cosine.shape[0], device=cosine.device)
        target = self.target_logit(cosine[rows, labels])
        logits = cosine.index_put((rows, labels), target)
        return logits * self.scale

    def forward(self, cosine: Tensor, labels: Tensor, reduction: Reduction = "mean") -> Tensor:
        """Cross-entropy of the margin logits; ``cosine`` is [B, C], ``labels`` [B].

        ``reduction="none"`` gives the ``[B]`` per-sample losses (for sample weights), ``"mean"`` their mean.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"Unknown `reduction`={reduction!r}; valid choices: {', '.join(REDUCTIONS)}")
        with torch.autocast(device_type=cosine.device.type, enabled=False):
            return F.cross_entropy(self.margin_logits(cosine.float(), labels), labels, reduction=reduction)

    def extra_repr(self) -> str:
        return f"margin_list=({self.m1}, {self.m2}, {self.m3}), scale={self.scale}"
