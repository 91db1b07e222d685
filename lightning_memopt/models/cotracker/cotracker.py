"""CoTracker2, CoTracker3 (online) and CoTracker3 (offline): the presets' correlation, tokens and refinement.

Each builds on :class:`~lightning_memopt.models.cotracker.base.CoTracker` (fnet, update transformer,
sliding windows) and supplies its correlation module, its per-clip context and the refinement of one
window. Within a window, the features of the tracks not yet queried by its last frame are zero
(CoTracker2 also masks them in the space attention). The offline CoTracker3 processes the whole clip
as one window. Given the same weights, each preset computes what the official implementation
(facebookresearch/co-tracker) computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.cotracker.base import CoTracker
from lightning_memopt.models.cotracker.correlation import FullCorrelation, LocalCorrelation, feature_pyramid
from lightning_memopt.models.cotracker.embeddings import flow_embedding, fourier_encoding, grid_sincos_embedding_2d
from lightning_memopt.models.cotracker.sampling import sample_at_frames
from lightning_memopt.models.cotracker.windows import TrackContext, TrackerOutput, WindowPrediction, WindowState

__all__ = ["CoTracker", "CoTracker2", "CoTracker3", "CoTracker3Offline", "TrackerOutput"]


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
