"""The sliding windows of the CoTracker models: what a window starts from, predicts, and how the windows are stitched.

A clip of ``T`` frames is covered by windows of ``window_len`` frames every ``window_len // 2``
frames, the clip padded (last frame repeated) until they cover it. A window starts from the query
positions, except for the tracks queried before its overlap with the previous window ends: those
continue from that window's last predictions. Each frame of the output comes from the last window
that covers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass
class TrackerOutput:
    """What a tracker predicts for every query: final tracks, and every window's every iteration for the losses.

    Positions are ``(x, y)`` in pixels of the input video; visibility and confidence are logits.

    Attributes:
        tracks: [B, T, N, 2] final positions (each frame from the last window that covers it).
        visibility: [B, T, N] final visibility logits.
        confidence: [B, T, N] final confidence logits (CoTracker3), or None.
        window_tracks: [W, I, B, S, N, 2] positions after each of the I iterations of each of the W windows.
        window_visibility: [W, J, B, S, N] visibility logits; J = I for CoTracker3, J = 1 for CoTracker2
            (which predicts visibility once, after the last iteration).
        window_confidence: [W, I, B, S, N] confidence logits, or None.
        window_starts: first frame of each window; window ``w`` covers frames ``start_w … start_w + S − 1``.
        num_frames: T; frames of the last window at or past T are padding.
    """

    tracks: Tensor
    visibility: Tensor
    confidence: Tensor | None
    window_tracks: Tensor
    window_visibility: Tensor
    window_confidence: Tensor | None
    window_starts: tuple[int, ...]
    num_frames: int

    def window_frames(self) -> Tensor:
        """[W, S] frame index of every window position (indices ≥ ``num_frames`` are padding)."""
        window_len = self.window_tracks.shape[3]
        starts = torch.tensor(self.window_starts, device=self.window_tracks.device)
        return starts[:, None] + torch.arange(window_len, device=starts.device)


class TrackContext(NamedTuple):
    """Per-clip inputs of the windows: feature pyramid [B, T, C, h, w] per level, query features per level
    [B, N, P, C] (P = 1 for CoTracker2, the (2r+1)² window around each query for CoTracker3), query frames [B, N]."""

    pyramid: list[Tensor]
    query_features: list[Tensor]
    query_frames: Tensor


class WindowState(NamedTuple):
    """Where a window starts: positions [B, S, N, 2] (feature pixels), visibility and confidence logits [B, S, N]."""

    coords: Tensor
    visibility: Tensor
    confidence: Tensor


class WindowPrediction(NamedTuple):
    """A window's predictions: positions [I, B, S, N, 2] (feature pixels), visibility [J, B, S, N], confidence."""

    coords: Tensor
    visibility: Tensor
    confidence: Tensor | None


def sliding_windows(window_len: int, num_frames: int) -> tuple[int, int, tuple[int, ...]]:
    """``(padded length, frames per window, window starts)`` for a clip of ``num_frames``: windows of
    ``window_len`` every ``window_len // 2`` frames, the clip padded until they cover it.

    Example::

        >>> sliding_windows(8, 12), sliding_windows(4, 5)
        ((12, 8, (0, 4)), (6, 4, (0, 2)))
    """
    step = window_len // 2
    padded_len = max(window_len, num_frames + (step - (num_frames - window_len) % step) % step)
    return padded_len, window_len, tuple(range(0, padded_len - window_len + 1, step))


def initial_state(
    query_coords: Tensor,
    start: int,
    query_frames: Tensor,
    window_len: int,
    previous: WindowState | None,
    initial_visibility: float,
) -> WindowState:
    """Query positions [B, N, 2] everywhere, except tracks queried before the overlap ends: the previous window's
    predictions over the overlap, the last one repeated. Visibility starts at ``initial_visibility``, confidence at 0.

    Example::

        >>> state = initial_state(torch.zeros(1, 1, 2), 0, torch.zeros(1, 1), 4, None, initial_visibility=10.0)
        >>> state.coords.shape, state.visibility.flatten().tolist()
        (torch.Size([1, 4, 1, 2]), [10.0, 10.0, 10.0, 10.0])
    """
    batch, num_tracks = query_coords.shape[:2]
    coords = query_coords[:, None].expand(batch, window_len, num_tracks, 2)
    visibility = coords.new_full((batch, window_len, num_tracks), initial_visibility)
    confidence = coords.new_zeros((batch, window_len, num_tracks))
    if previous is None:
        return WindowState(coords, visibility, confidence)
    step = window_len // 2
    overlap = window_len - step
    carried = query_frames < start + overlap  # B N

    def carry(initial: Tensor, predicted: Tensor) -> Tensor:
        last = predicted[:, -overlap:]
        continued = torch.cat([last, last[:, -1:].expand(-1, step, *last.shape[2:])], dim=1)
        mask = carried[:, None] if initial.dim() == 3 else carried[:, None, :, None]
        return torch.where(mask, continued, initial)

    return WindowState(
        carry(coords, previous.coords),
        carry(visibility, previous.visibility),
        carry(confidence, previous.confidence),
    )


def stitch_windows(per_window: Tensor, window_len: int, num_frames: int) -> Tensor:
    """[W, B, S, ...] → [B, T, ...]: each of the ``num_frames`` frames from the last window that covers it.

    Example::

        >>> stitch_windows(torch.arange(8).view(2, 1, 4), window_len=4, num_frames=5).tolist()
        [[0, 1, 4, 5, 6]]
    """
    return torch.cat([*per_window[:-1, :, : window_len // 2], per_window[-1]], dim=1)[:, :num_frames]
