"""CoTracker2, CoTracker3 (online) and CoTracker3 (offline): track points through a video by iterative refinement.

Shared machinery (:class:`CoTracker`): the video is resized to ``model_resolution``, scaled to
[-1, 1] and padded (last frame repeated) so that windows of ``window_len`` frames with stride
``window_len // 2`` cover it; the fnet turns every frame into stride-4 features; every window
starts from the query positions, or, for tracks queried before the overlap with the previous
window ends, from that window's last predictions; the update transformer then refines positions
(and visibility / confidence) ``iters`` times. Within a window, the features of the tracks not yet
queried by its last frame are zero (CoTracker2 also masks them in the space attention). The
offline CoTracker3 processes the whole clip as one window. Given the same weights, each preset
computes what the official implementation (facebookresearch/co-tracker) computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.cotracker.correlation import FullCorrelation, LocalCorrelation, feature_pyramid
from lightning_memopt.models.cotracker.embeddings import (
    flow_embedding,
    fourier_encoding,
    grid_sincos_embedding_2d,
    sincos_embedding,
)
from lightning_memopt.models.cotracker.fnet import BasicEncoder
from lightning_memopt.models.cotracker.sampling import sample_at_frames
from lightning_memopt.models.cotracker.updateformer import UpdateFormer
from lightning_memopt.models.structure import MemoryStructure, check_attn_impl


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
        step = self.window_len // 2
        padded_len = max(self.window_len, num_frames + (step - (num_frames - self.window_len) % step) % step)
        return padded_len, self.window_len, tuple(range(0, padded_len - self.window_len + 1, step))

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

    def _initial_state(
        self, query_coords: Tensor, start: int, query_frames: Tensor, window_len: int, previous: WindowState | None
    ) -> WindowState:
        """Query positions everywhere, except tracks queried before the overlap ends: the previous window's
        predictions over the overlap, the last one repeated."""
        batch, num_tracks = query_coords.shape[:2]
        coords = query_coords[:, None].expand(batch, window_len, num_tracks, 2)
        visibility = coords.new_full((batch, window_len, num_tracks), self.initial_visibility)
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
            state = self._initial_state(query_coords, start, query_frames, window_len, previous)
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

        def stitch(per_window: Tensor) -> Tensor:  # [W, B, S, ...] -> [B, T, ...], each frame from its last window
            return torch.cat([*per_window[:-1, :, : window_len // 2], per_window[-1]], dim=1)[:, :num_frames]

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


class CoTracker2(CoTracker):
    """CoTracker2: full correlation volumes, track features updated with the positions.

    Tokens (456 at radius 3, 360 at radius 2): flow embedding (130, see
    :func:`~lightning_memopt.models.cotracker.embeddings.flow_embedding`) ‖ correlation
    ``levels·(2r+1)²`` ‖ track features (``latent_dim``) ‖ (track mask, visibility); plus the
    sinusoidal table of the integer feature grid interpolated at each track's position in the
    window's first frame, and the embedding of the frame in the window. The transformer predicts
    Δ positions and Δ features; visibility is read from the refined features after the last
    iteration. Points not yet queried by a window's last frame are masked in the space attention.

    Args:
        window_len: frames per window (8).
        corr_levels: correlation pyramid levels (4).
        corr_radius: correlation window radius (3).
        latent_dim: feature channels (128).
        flow_embed_dim: sinusoidal channels per axis of the flow embedding (64, even).
        time_depth: transformer time blocks (6).
        space_depth: transformer space blocks (6).
        padding_mode: what samples outside the feature maps read: ``"border"`` (official) or ``"zeros"``.
        **options: the remaining arguments of :class:`CoTracker` (``iters``, ``model_resolution``,
            ``attn_impl``, ``hidden_dim`` …).

    Raises:
        ValueError: for an argument out of range.

    Example::

        >>> tracker = CoTracker2(window_len=4, corr_levels=2, corr_radius=1, latent_dim=16, hidden_dim=16,
        ...                      num_heads=2, time_depth=1, space_depth=1, num_virtual_tracks=2,
        ...                      fnet_widths=(8, 8, 16, 16), fnet_hidden_dim=16, model_resolution=(32, 32), iters=2)
        >>> video, queries = torch.rand(1, 6, 3, 32, 32) * 255, torch.tensor([[[0.0, 5.0, 5.0], [3.0, 9.0, 20.0]]])
        >>> out = tracker(video, queries)
        >>> out.tracks.shape, out.window_tracks.shape, out.window_starts
        (torch.Size([1, 6, 2, 2]), torch.Size([2, 2, 1, 4, 2, 2]), (0, 2))
    """

    initial_visibility = 10.0

    def __init__(
        self,
        window_len: int = 8,
        corr_levels: int = 4,
        corr_radius: int = 3,
        latent_dim: int = 128,
        flow_embed_dim: int = 64,
        time_depth: int = 6,
        space_depth: int = 6,
        padding_mode: str = "border",
        **options: object,
    ) -> None:
        if flow_embed_dim < 2 or flow_embed_dim % 2:
            raise ValueError(f"`flow_embed_dim`={flow_embed_dim!r} must be even and at least 2")
        correlation = FullCorrelation(corr_levels, corr_radius, padding_mode)
        token_dim = (2 + 2 * flow_embed_dim) + correlation.output_dim + latent_dim + 2
        super().__init__(
            correlation,
            token_dim,
            update_dim=2 + latent_dim,
            window_len=window_len,
            time_depth=time_depth,
            space_depth=space_depth,
            latent_dim=latent_dim,
            **options,  # type: ignore[arg-type]
        )
        self.flow_embed_dim = flow_embed_dim
        self.feature_norm = nn.GroupNorm(1, latent_dim)
        self.feature_update = nn.Sequential(nn.Linear(latent_dim, latent_dim), nn.GELU())
        self.visibility_head = nn.Linear(latent_dim, 1)

    def track_context(self, fmaps: Tensor, query_frames: Tensor, query_coords: Tensor) -> TrackContext:
        query_feat = sample_at_frames(fmaps, query_frames, query_coords, padding_mode=self.correlation.padding_mode)
        return TrackContext(feature_pyramid(fmaps, self.correlation.levels), [query_feat], query_frames)

    def refine_window(
        self, context: TrackContext, start: int, state: WindowState, point_mask: Tensor, iters: int
    ) -> WindowPrediction:
        batch, frames, num_tracks, _ = state.coords.shape
        track_feat = (context.query_features[0][:, :, 0] * point_mask[..., None])[:, None]
        track_feat = track_feat.expand(batch, frames, num_tracks, self.latent_dim)
        query_frames = context.query_frames
        frame_index = torch.arange(start, start + frames, device=query_frames.device)
        first_new_frame = 0 if start == 0 else start + frames - frames // 2
        track_mask = (query_frames[:, None, :] <= frame_index[:, None]) & (frame_index[:, None] >= first_new_frame)
        flags = torch.stack([track_mask.to(state.visibility.dtype), state.visibility], dim=-1)
        grid_size = (self.model_resolution[0] // self.stride, self.model_resolution[1] // self.stride)
        position = grid_sincos_embedding_2d(state.coords[:, 0], self.token_dim, grid_size)[:, None]  # B 1 N D
        time = self.time_embedding(frames, frame_index.device)[:, None]  # S 1 D
        coords = state.coords
        all_coords = []
        for _ in range(iters):
            coords = coords.detach()
            corr = self.correlation(context.pyramid, track_feat, coords)
            flow = flow_embedding(coords - coords[:, :1], self.flow_embed_dim)
            tokens = torch.cat([flow, corr, track_feat, flags], dim=-1) + position + time
            delta = self.predict_update(tokens, point_mask)
            coords = coords + delta[..., :2]
            feature_delta = self.feature_norm(delta[..., 2:].reshape(-1, self.latent_dim)).view_as(track_feat)
            track_feat = track_feat + self.feature_update(feature_delta)
            all_coords.append(coords)
        visibility = self.visibility_head(track_feat)[..., 0]
        return WindowPrediction(torch.stack(all_coords), visibility[None], None)


class CoTracker3(CoTracker):
    """CoTracker3 (online): local 4-D correlation embedded by an MLP, visibility and confidence refined too.

    Tokens (1110 by default): visibility ‖ confidence ‖ correlation embeddings ``levels × 256`` ‖ a
    Fourier encoding (84) of the forward and backward motion to the neighbouring frames; plus a
    sinusoidal embedding of the frame in the window. Features are L2-normalised per pixel
    (``f / √max(Σf², 1e-12)``). The transformer predicts Δ positions, Δ visibility and Δ confidence
    at every iteration; as in the official model, its space attention sees every point (the
    not-yet-queried ones have zero features, but their tokens still take part).

    Args:
        window_len: frames per window (16).
        corr_levels: correlation pyramid levels (4).
        corr_radius: correlation window radius (3): ``(2r+1)⁴`` = 2401 values per level.
        corr_hidden_dim: hidden width of the correlation MLP (384).
        corr_embed_dim: correlation embedding per level (256).
        time_depth: transformer time blocks (3).
        space_depth: transformer space blocks (3).
        padding_mode: what samples outside the feature maps read: ``"border"`` (official) or ``"zeros"``.
        mask_unqueried: mask the points not yet queried by a window's last frame in the space attention,
            as CoTracker2 does, so that they cannot influence the other tracks (not in the official
            CoTracker3; False by default).
        **options: the remaining arguments of :class:`CoTracker`.

    Raises:
        ValueError: for an argument out of range.

    Example::

        >>> tracker = CoTracker3(window_len=4, corr_levels=2, corr_radius=1, corr_hidden_dim=16, corr_embed_dim=8,
        ...                      latent_dim=16, hidden_dim=16, num_heads=2, time_depth=1, space_depth=1,
        ...                      num_virtual_tracks=2, fnet_widths=(8, 8, 16, 16), fnet_hidden_dim=16,
        ...                      model_resolution=(32, 32), iters=2)
        >>> out = tracker(torch.rand(1, 4, 3, 32, 32) * 255, torch.tensor([[[0.0, 5.0, 5.0]]]))
        >>> out.tracks.shape, out.confidence.shape, out.window_visibility.shape
        (torch.Size([1, 4, 1, 2]), torch.Size([1, 4, 1]), torch.Size([1, 2, 1, 4, 1]))
    """

    motion_degrees = 10  # Fourier degrees 0…9 of the 4 motion values: 4 · (1 + 2·10) = 84 channels

    def __init__(
        self,
        window_len: int = 16,
        corr_levels: int = 4,
        corr_radius: int = 3,
        corr_hidden_dim: int = 384,
        corr_embed_dim: int = 256,
        time_depth: int = 3,
        space_depth: int = 3,
        padding_mode: str = "border",
        mask_unqueried: bool = False,
        **options: object,
    ) -> None:
        correlation = LocalCorrelation(corr_levels, corr_radius, corr_hidden_dim, corr_embed_dim, padding_mode)
        token_dim = 2 + correlation.output_dim + 4 * (1 + 2 * self.motion_degrees)
        super().__init__(
            correlation,
            token_dim,
            update_dim=4,
            window_len=window_len,
            time_depth=time_depth,
            space_depth=space_depth,
            **options,  # type: ignore[arg-type]
        )
        self.mask_unqueried = mask_unqueried

    def track_context(self, fmaps: Tensor, query_frames: Tensor, query_coords: Tensor) -> TrackContext:
        unit = fmaps / fmaps.square().sum(dim=2, keepdim=True).clamp(min=1e-12).sqrt()
        pyramid = feature_pyramid(unit, self.correlation.levels)
        radius, padding_mode = self.correlation.radius, self.correlation.padding_mode
        windows = [
            sample_at_frames(level, query_frames, query_coords / 2**index, radius, padding_mode)
            for index, level in enumerate(pyramid)
        ]
        return TrackContext(pyramid, windows, query_frames)

    def refine_window(
        self, context: TrackContext, start: int, state: WindowState, point_mask: Tensor, iters: int
    ) -> WindowPrediction:
        frames = state.coords.shape[1]
        support = [window * point_mask[:, :, None, None] for window in context.query_features]
        device = state.coords.device
        time = self.time_embedding(frames, device)[:, None]  # S 1 D
        feature_size = torch.tensor(self.model_resolution[::-1], device=device) / self.stride
        coords, visibility, confidence = state
        all_coords, all_visibility, all_confidence = [], [], []
        for _ in range(iters):
            coords = coords.detach()
            corr = self.correlation(context.pyramid, support, coords)
            forward_motion = F.pad(coords[:, :-1] - coords[:, 1:], (0, 0, 0, 0, 0, 1))
            backward_motion = F.pad(coords[:, 1:] - coords[:, :-1], (0, 0, 0, 0, 1, 0))
            motion = torch.cat([forward_motion, backward_motion], dim=-1) / feature_size.repeat(2)
            motion_code = fourier_encoding(motion, 0, self.motion_degrees)
            tokens = torch.cat([visibility[..., None], confidence[..., None], corr, motion_code], dim=-1) + time
            delta = self.predict_update(tokens, point_mask if self.mask_unqueried else None)
            coords = coords + delta[..., :2]
            visibility = visibility + delta[..., 2]
            confidence = confidence + delta[..., 3]
            all_coords.append(coords)
            all_visibility.append(visibility)
            all_confidence.append(confidence)
        return WindowPrediction(torch.stack(all_coords), torch.stack(all_visibility), torch.stack(all_confidence))


class CoTracker3Offline(CoTracker3):
    """CoTracker3 (offline): the whole clip in one pass, with the parameters of the online CoTracker3.

    No sliding windows, no padding and no masks: every frame is refined at once and every track
    starts from its query position with features taken at its query frame, whatever that frame.
    ``window_len`` (60) is the length of the time-embedding table, linearly interpolated to the
    clip's length. The output is one "window" of ``T`` frames starting at frame 0.

    Args:
        window_len: length of the time-embedding table (60).
        **options: the arguments of :class:`CoTracker3`.

    Raises:
        ValueError: for an argument out of range.

    Example::

        >>> tracker = CoTracker3Offline(window_len=4, corr_levels=2, corr_radius=1, corr_hidden_dim=16,
        ...                             corr_embed_dim=8, latent_dim=16, hidden_dim=16, num_heads=2, time_depth=1,
        ...                             space_depth=1, num_virtual_tracks=2, fnet_widths=(8, 8, 16, 16),
        ...                             fnet_hidden_dim=16, model_resolution=(32, 32), iters=2)
        >>> out = tracker(torch.rand(1, 7, 3, 32, 32) * 255, torch.tensor([[[5.0, 5.0, 5.0]]]))
        >>> out.tracks.shape, out.window_tracks.shape, out.window_starts
        (torch.Size([1, 7, 1, 2]), torch.Size([1, 2, 1, 7, 1, 2]), (0,))
    """

    def __init__(self, window_len: int = 60, **options: object) -> None:
        super().__init__(window_len=window_len, **options)  # type: ignore[arg-type]

    def window_plan(self, num_frames: int) -> tuple[int, int, tuple[int, ...]]:
        """One window of the whole clip, unpadded."""
        return num_frames, num_frames, (0,)
