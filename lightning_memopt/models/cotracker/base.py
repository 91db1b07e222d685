"""The base of the CoTracker models: fnet, update transformer and the loop over sliding windows.

The video is resized to ``model_resolution``, scaled to [-1, 1] and padded (last frame repeated) so
that windows of ``window_len`` frames with stride ``window_len // 2`` cover it; the fnet turns every
frame into stride-4 features; every window starts from the query positions, or, for tracks queried
before the overlap with the previous window ends, from that window's last predictions
(:mod:`~lightning_memopt.models.cotracker.windows`); a subclass's ``refine_window`` then refines
positions (and visibility / confidence) ``iters`` times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.cotracker.correlation import FullCorrelation, LocalCorrelation
from lightning_memopt.models.cotracker.embeddings import sincos_embedding
from lightning_memopt.models.cotracker.fnet import BasicEncoder
from lightning_memopt.models.cotracker.updateformer import UpdateFormer
from lightning_memopt.models.cotracker.windows import (
    TrackContext,
    TrackerOutput,
    WindowPrediction,
    WindowState,
    initial_state,
    sliding_windows,
    stitch_windows,
)
from lightning_memopt.models.structure import MemoryStructure, check_attn_impl


class CoTracker(nn.Module):
    """Base of CoTracker2 and CoTracker3: fnet, sliding windows and the update transformer.

    A subclass builds the correlation module and the token layout and implements
    ``track_context`` and ``refine_window``.

    Args:
        correlation: the correlation module (its ``levels`` sets the feature pyramid depth, its
            ``padding_mode`` how every sampling treats points outside the maps).
        token_dim: width of the transformer input tokens.
        update_dim: width of the per-token update the transformer predicts.
        window_len: frames per window (even, at least 2); windows move by half of it. It is also the
            length of the time-embedding table.
        iters: refinement iterations per window (default of ``forward``).
        model_resolution: ``(height, width)`` the video is resized to; multiples of ``stride``.
        attn_impl: ``"sdpa"`` or ``"math"`` attention.
        stride: fnet output stride.
        latent_dim: fnet output channels.
        fnet_widths: channels of the fnet's four stages.
        fnet_hidden_dim: channels of the fnet's fusing convolution.
        hidden_dim: transformer width.
        num_heads: attention heads.
        time_depth: transformer time blocks.
        space_depth: transformer space blocks.
        mlp_ratio: transformer MLP width over ``hidden_dim``.
        num_virtual_tracks: learned virtual tracks of the space attention.

    Raises:
        ValueError: for an argument out of range or an unknown ``attn_impl``.
    """

    initial_visibility: float = 0.0  # visibility logit every track starts from

    def __init__(
        self,
        correlation: FullCorrelation | LocalCorrelation,
        token_dim: int,
        update_dim: int,
        *,
        window_len: int,
        time_depth: int,
        space_depth: int,
        latent_dim: int = 128,
        iters: int = 4,
        model_resolution: Sequence[int] = (384, 512),
        attn_impl: str = "sdpa",
        stride: int = 4,
        fnet_widths: Sequence[int] = (64, 96, 128, 128),
        fnet_hidden_dim: int = 256,
        hidden_dim: int = 384,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        num_virtual_tracks: int = 64,
    ) -> None:
        super().__init__()
        if window_len < 2 or window_len % 2:
            raise ValueError(f"`window_len`={window_len!r} must be an even number of frames, at least 2")
        if iters < 1:
            raise ValueError(f"`iters`={iters!r} must be at least 1")
        smallest_side = stride * 2 ** (correlation.levels - 1)
        if len(model_resolution) != 2 or any(side < smallest_side or side % stride for side in model_resolution):
            raise ValueError(
                f"`model_resolution`={list(model_resolution)!r} must be (height, width), multiples of `stride`={stride}"
                f" and at least {smallest_side} (stride · 2^(corr_levels − 1))"
            )
        check_attn_impl(attn_impl)
        self.window_len = window_len
        self.iters = iters
        self.model_resolution = (int(model_resolution[0]), int(model_resolution[1]))
        self.stride = stride
        self.latent_dim = latent_dim
        self.token_dim = token_dim
        self.fnet = BasicEncoder(fnet_widths, fnet_hidden_dim, latent_dim, stride)
        self.correlation = correlation
        self.updateformer = UpdateFormer(
            token_dim,
            update_dim,
            hidden_dim=hidden_dim,
            num_heads=num_heads,
            time_depth=time_depth,
            space_depth=space_depth,
            mlp_ratio=mlp_ratio,
            num_virtual_tracks=num_virtual_tracks,
            attn_impl=attn_impl,
        )

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the feature encoder and the correlation module (the update transformer declares its own)."""
        return MemoryStructure(blocks=(self.fnet, self.correlation))

    def track_context(self, fmaps: Tensor, query_frames: Tensor, query_coords: Tensor) -> TrackContext:
        """Per-clip context from fnet features [B, T, C, h, w], query frames [B, N] and positions [B, N, 2]."""
        raise NotImplementedError

    def refine_window(
        self, context: TrackContext, start: int, state: WindowState, point_mask: Tensor, iters: int
    ) -> WindowPrediction:
        """Refine the window starting at frame ``start`` from ``state``.

        ``context`` holds the window's frames of the pyramid; ``point_mask`` [B, N] marks the tracks queried
        by the window's last frame.
        """
        raise NotImplementedError

    def predict_update(self, tokens: Tensor, point_mask: Tensor | None) -> Tensor:
        """The transformer's update of tokens [B, S, N, D]: attention per track over S, per frame over N
        (with the not-yet-queried points, those not in ``point_mask``, masked; None: no mask)."""
        return self.updateformer(tokens.transpose(1, 2), point_mask).transpose(1, 2)

    def time_table(self, device: torch.device | None = None) -> Tensor:
        """[window_len, token_dim] sinusoidal embedding of the frames 0 … window_len − 1 (the official ``time_emb``)."""
        return sincos_embedding(torch.arange(self.window_len, device=device, dtype=torch.float32), self.token_dim)

    def time_embedding(self, frames: int, device: torch.device) -> Tensor:
        """[frames, token_dim]: the time table, linearly interpolated (``align_corners=False``) to ``frames`` rows
        when that differs from ``window_len``."""
        table = self.time_table(device)
        if frames == self.window_len:
            return table
        return F.interpolate(table.T[None], size=frames, mode="linear", align_corners=False)[0].T

    def window_plan(self, num_frames: int) -> tuple[int, int, tuple[int, ...]]:
        """``(padded length, frames per window, window starts)`` for a clip of ``num_frames``: windows of
        ``window_len`` every ``window_len // 2`` frames, the clip padded until they cover it."""
        return sliding_windows(self.window_len, num_frames)

    def _input_to_model_scale(self, height: int, width: int, device: torch.device) -> Tensor:
        model_height, model_width = self.model_resolution
        return torch.tensor(
            [(model_width - 1) / max(width - 1, 1), (model_height - 1) / max(height - 1, 1)], device=device
        )

    def _model_frames(self, video: Tensor, padded_len: int) -> Tensor:
        """[B, T, 3, H, W] in [0, 255] → [B, padded_len, 3, *model_resolution] in [-1, 1], last frame repeated."""
        batch, num_frames = video.shape[:2]
        frames = video.flatten(0, 1)
        if tuple(frames.shape[-2:]) != self.model_resolution:
            frames = F.interpolate(frames, size=self.model_resolution, mode="bilinear", align_corners=True)
        frames = frames.unflatten(0, (batch, num_frames)) / 255.0 * 2.0 - 1.0
        padding = frames[:, -1:].expand(-1, padded_len - num_frames, -1, -1, -1)
        return torch.cat([frames, padding], dim=1)

    def forward(self, video: Tensor, queries: Tensor, iters: int | None = None) -> TrackerOutput:
        """Track ``queries`` [B, N, 3] of ``(frame, x, y)`` through ``video`` [B, T, 3, H, W] with values in [0, 255].

        Raises:
            ValueError: ``video`` or ``queries`` has the wrong shape, or ``iters`` < 1.
        """
        if video.dim() != 5 or video.shape[2] != 3:
            raise ValueError(f"`video` must be [B, T, 3, H, W], got shape {tuple(video.shape)}")
        if queries.dim() != 3 or queries.shape[-1] != 3 or queries.shape[0] != video.shape[0]:
            raise ValueError(f"`queries` must be [B, N, 3] of (frame, x, y), got shape {tuple(queries.shape)}")
        iters = self.iters if iters is None else iters
        if iters < 1:
            raise ValueError(f"`iters`={iters!r} must be at least 1")
        batch, num_frames, _, height, width = video.shape
        padded_len, window_len, starts = self.window_plan(num_frames)
        to_model = self._input_to_model_scale(height, width, video.device)
        frames = self._model_frames(video, padded_len)
        fmaps = self.fnet(frames.flatten(0, 1)).unflatten(0, (batch, padded_len))
        query_frames = queries[..., 0].round().long()
        query_coords = queries[..., 1:] * to_model / self.stride
        context = self.track_context(fmaps, query_frames, query_coords)
        predictions: list[WindowPrediction] = []
        previous: WindowState | None = None
        for start in starts:
            state = initial_state(query_coords, start, query_frames, window_len, previous, self.initial_visibility)
            point_mask = query_frames < start + window_len
            window = context._replace(pyramid=[level[:, start : start + window_len] for level in context.pyramid])
            prediction = self.refine_window(window, start, state, point_mask, iters)
            predictions.append(prediction)
            last_confidence = state.confidence if prediction.confidence is None else prediction.confidence[-1]
            previous = WindowState(prediction.coords[-1], prediction.visibility[-1], last_confidence)
        to_input = self.stride / to_model
        window_tracks = torch.stack([p.coords for p in predictions]) * to_input
        window_visibility = torch.stack([p.visibility for p in predictions])
        confidences = [p.confidence for p in predictions if p.confidence is not None]
        window_confidence = torch.stack(confidences) if confidences else None

        def stitch(per_window: Tensor) -> Tensor:
            return stitch_windows(per_window, window_len, num_frames)

        return TrackerOutput(
            tracks=stitch(window_tracks[:, -1]),
            visibility=stitch(window_visibility[:, -1]),
            confidence=None if window_confidence is None else stitch(window_confidence[:, -1]),
            window_tracks=window_tracks,
            window_visibility=window_visibility,
            window_confidence=window_confidence,
            window_starts=starts,
            num_frames=num_frames,
        )
