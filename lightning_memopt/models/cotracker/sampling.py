"""Bilinear sampling of feature maps at sub-pixel points, single points or square neighbourhoods.

Points are ``(x, y)`` in pixels of the map being sampled, with pixel centres at integer coordinates
(``x = 0`` is the centre of the first column, ``x = w - 1`` of the last), i.e. ``align_corners=True``.
Points outside the map read the nearest border value (``padding_mode="border"``, as the official
CoTracker), or zeros (``"zeros"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PADDING_MODES = ("border", "zeros")


def check_padding_mode(padding_mode: str) -> str:
    """``padding_mode`` if it is one of :data:`PADDING_MODES`.

    Raises:
        ValueError: for another value.

    Example::

        >>> check_padding_mode("border")
        'border'
    """
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"`padding_mode`={padding_mode!r} must be one of {', '.join(PADDING_MODES)}")
    return padding_mode


def neighbourhood_offsets(radius: int, device: torch.device | None = None) -> Tensor:
    """The ``(2r+1)²`` integer offsets ``(dx, dy)`` of a square window, column by column (dx outer, dy inner).

    Offset ``i·(2r+1) + j`` is ``(i − r, j − r)``: the official CoTracker's order.

    Example::

        >>> neighbourhood_offsets(1)[:4].tolist()
        [[-1.0, -1.0], [-1.0, 0.0], [-1.0, 1.0], [0.0, -1.0]]
    """
    steps = torch.arange(-radius, radius + 1, device=device, dtype=torch.float32)
    dx, dy = torch.meshgrid(steps, steps, indexing="ij")
    return torch.stack([dx, dy], dim=-1).reshape(-1, 2)


def _normalised(points: Tensor, height: int, width: int) -> Tensor:
    """Pixel coordinates → grid_sample's [-1, 1] (align_corners=True); a map of side 1 maps to -1."""
    scale = torch.tensor([2.0 / max(width - 1, 1), 2.0 / max(height - 1, 1)], device=points.device)
    return points * scale.to(points.dtype) - 1.0


def sample_neighbourhoods(maps: Tensor, centres: Tensor, radius: int, padding_mode: str = "border") -> Tensor:
    """Bilinearly sample a ``(2r+1)²`` window around every centre.

    Args:
        maps: [M, C, h, w] feature maps.
        centres: [M, K, 2] window centres ``(x, y)`` in pixels of ``maps``.
        radius: window radius ``r`` (0 samples the centres only).
        padding_mode: what points outside the map read: ``"border"`` or ``"zeros"``.

    Returns:
        [M, K, (2r+1)², C], window points in the order of :func:`neighbourhood_offsets`.

    Example::

        >>> maps = torch.arange(16.0).reshape(1, 1, 4, 4)
        >>> window = sample_neighbourhoods(maps, torch.tensor([[[1.5, 1.0]]]), radius=1)
        >>> window.shape, [round(v, 4) for v in window[0, 0, :, 0].tolist()]
        (torch.Size([1, 1, 9, 1]), [0.5, 4.5, 8.5, 1.5, 5.5, 9.5, 2.5, 6.5, 10.5])
        >>> sample_neighbourhoods(maps, torch.tensor([[[-3.0, 1.0]]]), radius=0).flatten().tolist()  # left border
        [4.0]
    """
    m, k = centres.shape[:2]
    offsets = neighbourhood_offsets(radius, centres.device).to(centres.dtype)
    points = centres[:, :, None, :] + offsets  # M K P 2
    grid = _normalised(points, *maps.shape[-2:])
    sampled = F.grid_sample(maps, grid.to(maps.dtype), mode="bilinear", padding_mode=padding_mode, align_corners=True)
    return sampled.permute(0, 2, 3, 1)  # M C K P -> M K P C


def sample_at_frames(
    fmaps: Tensor, frames: Tensor, centres: Tensor, radius: int = 0, padding_mode: str = "border"
) -> Tensor:
    """Bilinearly sample, for every track, a ``(2r+1)²`` window in the frame given for that track.

    A trilinear 3-D ``grid_sample`` whose time coordinate is an exact frame index reads that frame
    only, so no per-track copy of a frame is ever made.

    Args:
        fmaps: [B, T, C, h, w] feature maps of a clip.
        frames: [B, N] integer frame of each track.
        centres: [B, N, 2] window centres ``(x, y)`` in pixels of ``fmaps``.
        radius: window radius ``r``.
        padding_mode: what points outside the map read: ``"border"`` or ``"zeros"``.

    Returns:
        [B, N, (2r+1)², C].

    Example::

        >>> fmaps = torch.stack([torch.zeros(1, 2, 2), torch.ones(1, 2, 2)])[None]  # frame 1 holds ones
        >>> sample_at_frames(fmaps, torch.tensor([[1, 0]]), torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])).flatten().tolist()
        [1.0, 0.0]
    """
    num_frames, height, width = fmaps.shape[1], *fmaps.shape[-2:]
    offsets = neighbourhood_offsets(radius, centres.device).to(centres.dtype)
    points = _normalised(centres[:, :, None, :] + offsets, height, width)  # B N P 2
    time = frames.to(points.dtype) * (2.0 / max(num_frames - 1, 1)) - 1.0
    grid = torch.cat([points, time[:, :, None, None].expand(*points.shape[:3], 1)], dim=-1)  # B N P 3 (x, y, t)
    volume = fmaps.transpose(1, 2)  # B C T h w
    sampled = F.grid_sample(
        volume, grid[:, None].to(volume.dtype), mode="bilinear", padding_mode=padding_mode, align_corners=True
    )
    return sampled[:, :, 0].permute(0, 2, 3, 1)  # B C 1 N P -> B N P C
