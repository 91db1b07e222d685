"""The sample format of the point-tracking datasets, and how a sample's tracks are chosen.

A sample is a dict of four tensors:

- ``video``: float32 ``[T, 3, H, W]``, RGB in [0, 255] (the trackers scale it to [-1, 1] themselves);
- ``tracks``: float32 ``[T, N, 2]``, ``(x, y)`` in pixels, pixel centres at integer coordinates;
- ``visibility``: bool ``[T, N]``;
- ``queries``: float32 ``[N, 3]``, ``(t, x, y)``: the first frame where each track is visible and its
  position there.

Choosing ``N`` = ``traj_per_sample`` tracks from a clip's ``M``: tracks never visible are left out;
tracks visible in the first frame come before the others, in random order within each group. A clip
with fewer visible tracks than ``traj_per_sample`` repeats its chosen tracks, in the same order,
until there are enough (every sample of a dataset then batches with the others); a clip with no
visible track at all is an error.

Where tracks may lie (:func:`check_track_positions`, applied to every clip read from a file): pixel
centres are at integer coordinates, so the pixels of a ``W×H`` frame cover ``[-0.5, W - 0.5] ×
[-0.5, H - 0.5]``. A point marked visible must lie within :data:`VISIBLE_TOLERANCE` (1 px) of the
outermost pixel centres, ``x ∈ [-1, W]`` and ``y ∈ [-1, H]``. A point marked invisible may have left
the frame, but by at most :data:`OUTSIDE_MARGIN` (one frame size) past each edge, ``x ∈ [-W, 2W - 1]``
and ``y ∈ [-H, 2H - 1]``; farther positions are taken for a unit or resolution mistake (the tracks of
the original video kept after resizing it, sentinel values), which would train with huge losses.

Samples carry where they came from (:class:`TrackingSample`), so that :func:`collate_tracking_samples`
can name the clips of a batch that do not share one size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import default_collate

from lightning_memopt.arguments import InputError

VISIBLE_TOLERANCE = 1.0  # px: how far past the outermost pixel centres a visible point may lie
OUTSIDE_MARGIN = 1.0  # frame sizes: how far past each edge a point marked invisible may lie


class TrackingSample(dict):
    """A sample dict (``video``, ``tracks``, ``visibility``, ``queries``) that remembers its ``source``.

    ``source`` names where the sample came from (a clip's file, or ``"sample 3"`` of a synthetic
    dataset) for error messages; it is not part of the batch.

    Example::

        >>> sample = TrackingSample({"video": torch.zeros(1)}, source="clip.npz")
        >>> sample.source, sample == {"video": torch.zeros(1)}, list(sample)
        ('clip.npz', True, ['video'])
    """

    def __init__(self, items: Mapping[str, Tensor] | None = None, source: str | None = None) -> None:
        super().__init__(items or {})
        self.source = source


def check_track_positions(
    tracks: np.ndarray, visibility: np.ndarray, height: int, width: int, source: str = "tracking clip"
) -> None:
    """Refuse positions that are not finite, visible points outside the frame, and invisible points far outside.

    The bounds are those of the module docstring.

    Args:
        tracks: ``[T, N, 2]`` positions ``(x, y)`` in pixels.
        visibility: bool ``[T, N]``.
        height: frame rows ``H``.
        width: frame columns ``W``.
        source: what the message names (the clip's file).

    Raises:
        InputError: naming ``source``, the first offending frame and point, its position, the frame
            size, the bounds and how many positions break them.

    Example::

        >>> tracks = np.array([[[3.0, 2.0], [30.0, 2.0]]])  # frame 0: points 0 and 1
        >>> check_track_positions(tracks, np.array([[True, False]]), height=8, width=16)  # 1 is invisible: fine
        >>> check_track_positions(tracks, np.array([[True, True]]), 8, 16, "'a.npz'")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_memopt.arguments.InputError: 'a.npz': point 1 is marked visible in frame 0 at (x, y) = (30, 2), outside the 16×8 (W×H) frame: ...
    """  # noqa: E501
    tracks = np.asarray(tracks, dtype=np.float64)
    visibility = np.asarray(visibility, dtype=bool)
    finite = np.isfinite(tracks).all(axis=-1)
    if not finite.all():
        frame, point = np.argwhere(~finite)[0]
        raise InputError(
            f"{source}: `tracks` holds {int((~finite).sum())} positions that are NaN or infinite, the first of"
            f" point {point} in frame {frame}: {tuple(tracks[frame, point].tolist())}"
        )
    x, y = tracks[..., 0], tracks[..., 1]
    size = f"the {width}×{height} (W×H) frame"

    def first(bad: np.ndarray) -> tuple[int, int, str, int]:
        frame, point = (int(i) for i in np.argwhere(bad)[0])
        return frame, point, f"(x, y) = ({x[frame, point]:.6g}, {y[frame, point]:.6g})", int(bad.sum())

    low, high_x, high_y = -VISIBLE_TOLERANCE, width - 1 + VISIBLE_TOLERANCE, height - 1 + VISIBLE_TOLERANCE
    outside = visibility & ((x < low) | (x > high_x) | (y < low) | (y > high_y))
    if outside.any():
        frame, point, where, count = first(outside)
        raise InputError(
            f"{source}: point {point} is marked visible in frame {frame} at {where}, outside {size}: visible"
            f" points must lie within x ∈ [{low:g}, {high_x:g}] and y ∈ [{low:g}, {high_y:g}] (pixel centres at"
            f" integer coordinates, {VISIBLE_TOLERANCE:g} px tolerance); {count} visible"
            f" position{'s are' if count > 1 else ' is'} outside. Are the tracks in pixels of this video (not of"
            " another resolution)?"
        )
    margin_x, margin_y = OUTSIDE_MARGIN * width, OUTSIDE_MARGIN * height
    far = (x < -margin_x) | (x > width - 1 + margin_x) | (y < -margin_y) | (y > height - 1 + margin_y)
    if far.any():
        frame, point, where, count = first(far)
        raise InputError(
            f"{source}: point {point} (marked invisible) lies at {where} in frame {frame}, more than one frame"
            f" size outside {size}: a point that left the frame must stay within x ∈ [{-margin_x:g},"
            f" {width - 1 + margin_x:g}] and y ∈ [{-margin_y:g}, {height - 1 + margin_y:g}]; {count}"
            f" position{'s are' if count > 1 else ' is'} farther out. Are the tracks in pixels of this video?"
        )


def _describe(sample: Mapping[str, Tensor]) -> str:
    frames, _, height, width = sample["video"].shape
    return f"{frames} frames of {height}×{width} (H×W), {sample['tracks'].shape[1]} tracks"


def collate_tracking_samples(samples: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Batch tracking samples (``torch``'s default collation) after checking that they share one size.

    Raises:
        InputError: the samples differ in frames, ``H×W`` or number of tracks; the message lists each
            size with the samples of that size (their :attr:`TrackingSample.source`, else their
            position in the batch).

    Example::

        >>> def clip(frames, source):
        ...     video, tracks = torch.zeros(frames, 3, 4, 4), torch.zeros(frames, 2, 2)
        ...     return TrackingSample({"video": video, "tracks": tracks}, source)
        >>> collate_tracking_samples([clip(3, "a.npz"), clip(3, "b.npz")])["video"].shape
        torch.Size([2, 3, 3, 4, 4])
        >>> collate_tracking_samples([clip(3, "a.npz"), clip(5, "b.npz")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_memopt.arguments.InputError: cannot batch tracking clips of different sizes: 3 frames of 4×4 (H×W), 2 tracks: a.npz; 5 ...
    """  # noqa: E501
    sizes = [(tuple(sample["video"].shape), tuple(sample["tracks"].shape)) for sample in samples]
    if len(set(sizes)) > 1:
        groups: dict[str, list[str]] = {}
        for position, sample in enumerate(samples):
            source = getattr(sample, "source", None) or f"batch item {position}"
            groups.setdefault(_describe(sample), []).append(source)
        listing = "; ".join(
            f"{size}: {', '.join(sources[:3])}{f' and {len(sources) - 3} more' if len(sources) > 3 else ''}"
            for size, sources in groups.items()
        )
        raise InputError(
            f"cannot batch tracking clips of different sizes: {listing}. A batch needs one number of frames (set"
            " `sequence_len` to crop every clip to it), one frame size and one number of tracks, or set"
            " `batch_size=1`"
        )
    return default_collate([dict(sample) for sample in samples])


def select_tracks(visibility: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``count`` tracks of a clip, chosen as the module docstring says.

    Args:
        visibility: bool ``[T, M]``.
        count: how many tracks to choose, at least 1.
        rng: the source of the random order.

    Raises:
        ValueError: no track is visible in any frame.

    Example::

        >>> visibility = np.array([[False, True, False, False], [True, True, False, True]])
        >>> sorted(select_tracks(visibility, 3, np.random.default_rng(0)).tolist())
        [0, 1, 3]
        >>> select_tracks(visibility, 4, np.random.default_rng(0))[0].item()  # visible in frame 0 first
        1
        >>> len(select_tracks(visibility, 7, np.random.default_rng(0)))  # 3 visible tracks, repeated
        7
    """
    visibility = np.asarray(visibility, dtype=bool)
    candidates = np.flatnonzero(visibility.any(axis=0))
    if candidates.size == 0:
        raise InputError(
            f"none of the {visibility.shape[1]} tracks is visible in any of the {visibility.shape[0]} frames"
        )
    candidates = rng.permutation(candidates)
    order = np.argsort(~visibility[0, candidates], kind="stable")  # visible in the first frame first
    chosen = candidates[order]
    return chosen[np.arange(count) % chosen.size]


def tracking_sample(
    video: Tensor,
    tracks: np.ndarray,
    visibility: np.ndarray,
    count: int,
    rng: np.random.Generator,
    source: str | None = None,
) -> TrackingSample:
    """Assemble a sample of ``count`` tracks (see :func:`select_tracks`) with their queries.

    Args:
        video: float32 ``[T, 3, H, W]`` in [0, 255].
        tracks: float ``[T, M, 2]`` positions ``(x, y)`` in pixels.
        visibility: bool ``[T, M]``.
        count: ``traj_per_sample``.
        rng: the source of the random choice.
        source: where the clip came from, kept as the sample's ``source`` (for error messages).

    Raises:
        ValueError: no track is visible in any frame.

    Example::

        >>> tracks = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
        >>> visibility = np.array([[False, True, False], [True, True, False]])
        >>> sample = tracking_sample(torch.zeros(2, 3, 4, 4), tracks, visibility, 2, np.random.default_rng(0))
        >>> sample["queries"].tolist(), sample["visibility"].tolist()
        ([[0.0, 2.0, 3.0], [1.0, 6.0, 7.0]], [[True, False], [True, True]])
    """
    chosen = select_tracks(visibility, count, rng)
    chosen_tracks = np.asarray(tracks, dtype=np.float32)[:, chosen]
    chosen_visibility = np.asarray(visibility, dtype=bool)[:, chosen]
    query_frames = chosen_visibility.argmax(axis=0)  # the first visible frame
    query_points = chosen_tracks[query_frames, np.arange(count)]
    queries = np.concatenate([query_frames[:, None].astype(np.float32), query_points], axis=1)
    sample = {
        "video": video.float(),
        "tracks": torch.from_numpy(np.ascontiguousarray(chosen_tracks)),
        "visibility": torch.from_numpy(np.ascontiguousarray(chosen_visibility)),
        "queries": torch.from_numpy(queries),
    }
    return TrackingSample(sample, source)
