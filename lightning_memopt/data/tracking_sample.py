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
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


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
        raise ValueError(
            f"none of the {visibility.shape[1]} tracks is visible in any of the {visibility.shape[0]} frames"
        )
    candidates = rng.permutation(candidates)
    order = np.argsort(~visibility[0, candidates], kind="stable")  # visible in the first frame first
    chosen = candidates[order]
    return chosen[np.arange(count) % chosen.size]


def tracking_sample(
    video: Tensor, tracks: np.ndarray, visibility: np.ndarray, count: int, rng: np.random.Generator
) -> dict[str, Tensor]:
    """Assemble a sample of ``count`` tracks (see :func:`select_tracks`) with their queries.

    Args:
        video: float32 ``[T, 3, H, W]`` in [0, 255].
        tracks: float ``[T, M, 2]`` positions ``(x, y)`` in pixels.
        visibility: bool ``[T, M]``.
        count: ``traj_per_sample``.
        rng: the source of the random choice.

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
    return {
        "video": video.float(),
        "tracks": torch.from_numpy(np.ascontiguousarray(chosen_tracks)),
        "visibility": torch.from_numpy(np.ascontiguousarray(chosen_visibility)),
        "queries": torch.from_numpy(queries),
    }
