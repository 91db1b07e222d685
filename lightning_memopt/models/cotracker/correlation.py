"""Correlation features of CoTracker: a full volume per pyramid level (v2) or a local 4-D one (v3).

Both sample a ``(2r+1)²`` window (x outer, y inner) around each track's current position at each level
of a feature pyramid (level ``l`` is average-pooled ``2^l`` times, positions divided by ``2^l``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.cotracker.sampling import check_padding_mode, sample_neighbourhoods


def check_levels_and_radius(levels: int, radius: int) -> None:
    """Raise ``ValueError`` unless ``levels`` >= 1 and ``radius`` >= 0.

    Example::

        >>> check_levels_and_radius(4, 3)
    """
    if levels < 1:
        raise ValueError(f"`corr_levels`={levels!r} must be at least 1")
    if radius < 0:
        raise ValueError(f"`corr_radius`={radius!r} must be at least 0")


def feature_pyramid(fmaps: Tensor, levels: int) -> list[Tensor]:
    """``levels`` maps ``[B, T, C, h/2^l, w/2^l]``, each a 2×2 average pooling of the previous one.

    Example::

        >>> [tuple(level.shape) for level in feature_pyramid(torch.zeros(1, 2, 4, 8, 8), 3)]
        [(1, 2, 4, 8, 8), (1, 2, 4, 4, 4), (1, 2, 4, 2, 2)]
    """
    pyramid = [fmaps]
    for _ in range(levels - 1):
        pooled = F.avg_pool2d(pyramid[-1].flatten(0, 1), kernel_size=2, stride=2)
        pyramid.append(pooled.unflatten(0, fmaps.shape[:2]))
    return pyramid


class FullCorrelation(nn.Module):
    """CoTracker2's correlation: per level, the full volume ``⟨track feature, every pixel⟩ / √C``,
    then bilinear samples of it in a ``(2r+1)²`` window around each track.

    The volume is materialised: ``B·S·N·h·w`` values per level, the memory-hungry part of v2.

    Args:
        levels: pyramid levels (4).
        radius: window radius ``r`` (3).
        padding_mode: what window points outside the volume read: ``"border"`` (official) or ``"zeros"``.

    Raises:
        ValueError: ``levels`` < 1, ``radius`` < 0 or an unknown ``padding_mode``.

    Example::

        >>> corr = FullCorrelation(levels=2, radius=1)
        >>> pyramid = feature_pyramid(torch.randn(1, 3, 8, 16, 16), 2)
        >>> corr(pyramid, torch.randn(1, 3, 5, 8), torch.rand(1, 3, 5, 2) * 15).shape
        torch.Size([1, 3, 5, 18])
    """

    def __init__(self, levels: int = 4, radius: int = 3, padding_mode: str = "border") -> None:
        super().__init__()
        check_levels_and_radius(levels, radius)
        self.levels = levels
        self.radius = radius
        self.padding_mode = check_padding_mode(padding_mode)
        self.output_dim = levels * (2 * radius + 1) ** 2

    def forward(self, pyramid: list[Tensor], track_feat: Tensor, coords: Tensor) -> Tensor:
        """Pyramid of [B, S, C, h, w], track features [B, S, N, C], positions [B, S, N, 2] → [B, S, N, out]."""
        batch, frames, tracks, channels = track_feat.shape
        sampled = []
        for level, fmaps in enumerate(pyramid):
            volume = torch.einsum("bsnc,bschw->bsnhw", track_feat, fmaps) * channels**-0.5
            centres = coords.reshape(-1, 1, 2) / 2**level
            window = sample_neighbourhoods(volume.flatten(0, 2)[:, None], centres, self.radius, self.padding_mode)
            sampled.append(window.reshape(batch, frames, tracks, -1))
        return torch.cat(sampled, dim=-1)


class LocalCorrelation(nn.Module):
    """CoTracker3's correlation: per level, the 4-D correlation between the ``(2r+1)²`` feature window
    around each track's query point and the window around its current position, ``(2r+1)⁴`` values
    (2401 at r = 3) embedded by an MLP ``(2r+1)⁴ → hidden → output``.

    Args:
        levels: pyramid levels (4).
        radius: window radius ``r`` (3).
        hidden_dim: MLP hidden width (384).
        output_dim: embedding width per level (256).
        padding_mode: what window points outside the feature map read: ``"border"`` (official) or ``"zeros"``.

    Raises:
        ValueError: ``levels`` < 1, ``radius`` < 0 or an unknown ``padding_mode``.

    Example::

        >>> corr = LocalCorrelation(levels=2, radius=1, hidden_dim=8, output_dim=4)
        >>> pyramid = feature_pyramid(torch.randn(1, 3, 8, 16, 16), 2)
        >>> support = [torch.randn(1, 5, 9, 8) for _ in range(2)]
        >>> corr(pyramid, support, torch.rand(1, 3, 5, 2) * 15).shape
        torch.Size([1, 3, 5, 8])
    """

    def __init__(
        self,
        levels: int = 4,
        radius: int = 3,
        hidden_dim: int = 384,
        output_dim: int = 256,
        padding_mode: str = "border",
    ) -> None:
        super().__init__()
        check_levels_and_radius(levels, radius)
        self.levels = levels
        self.radius = radius
        self.padding_mode = check_padding_mode(padding_mode)
        self.output_dim = levels * output_dim
        window = (2 * radius + 1) ** 2
        self.mlp = nn.Sequential(nn.Linear(window * window, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, output_dim))

    def forward(self, pyramid: list[Tensor], support: list[Tensor], coords: Tensor) -> Tensor:
        """Pyramid of [B, S, C, h, w], query windows per level [B, N, P, C], positions [B, S, N, 2] → [B, S, N, out]."""
        batch, frames, tracks = coords.shape[:3]
        embedded = []
        for level, (fmaps, query_window) in enumerate(zip(pyramid, support, strict=True)):
            centres = coords.flatten(0, 1) / 2**level
            window = sample_neighbourhoods(fmaps.flatten(0, 1), centres, self.radius, self.padding_mode)
            window = window.unflatten(0, (batch, frames))  # B S N P C
            volume = torch.einsum("bsnpc,bnqc->bsnpq", window, query_window)
            embedded.append(self.mlp(volume.reshape(batch, frames, tracks, -1)))
        return torch.cat(embedded, dim=-1)
