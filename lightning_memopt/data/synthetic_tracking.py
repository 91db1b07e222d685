"""Synthetic point-tracking clips: textured layers moving along known paths, with exact tracks and occlusions.

A clip is a stack of layers drawn back to front: a textured background larger than the frame that
pans slowly, then ``num_objects`` textured rectangles and ellipses, each moving along a path
``c(t) = c₀ + v·t + a·sin(ω·t + φ)``. A point is fixed on one layer at local coordinates ``(u, v)``, so
its track is exact; it is visible where it lies inside the frame and no nearer layer covers it
(:mod:`lightning_memopt.data.moving_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import check_int
from lightning_memopt.data.checks import check_size_pair
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.moving_layers import place_points, point_visibility, random_layers, render_layers
from lightning_memopt.data.resumable import SeededDataset, disjoint_ranges
from lightning_memopt.data.tracking_sample import collate_tracking_samples, tracking_sample

_CANDIDATES_PER_TRACK = 2  # points placed per track asked for, before the visible ones are chosen


class SyntheticTrackingDataset(SeededDataset):
    """``num_clips`` synthetic clips; clip ``i`` depends on ``(seed, first_clip + i)`` only and is rendered
    when it is read, as a sample dict of :mod:`lightning_memopt.data.tracking_sample`.

    Args:
        num_clips: number of clips.
        sequence_len: frames per clip.
        image_size: ``(H, W)``.
        traj_per_sample: tracks per sample.
        num_objects: moving shapes per clip.
        seed: seed of the whole dataset.
        first_clip: number of the first clip, so that datasets with non-overlapping ranges (train and
            validation) hold different clips.

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> import torch
        >>> dataset = SyntheticTrackingDataset(2, sequence_len=8, image_size=(32, 48), traj_per_sample=5, seed=0)
        >>> sample = dataset[1]
        >>> {key: tuple(value.shape) for key, value in sample.items()}
        {'video': (8, 3, 32, 48), 'tracks': (8, 5, 2), 'visibility': (8, 5), 'queries': (5, 3)}
        >>> torch.equal(sample["video"], dataset[1]["video"])
        True
    """

    def __init__(
        self,
        num_clips: int,
        sequence_len: int,
        image_size: Sequence[int],
        traj_per_sample: int,
        seed: int,
        num_objects: int = 3,
        first_clip: int = 0,
    ) -> None:
        num_clips = check_int("num_clips", num_clips, minimum=0)
        self.sequence_len = check_int("sequence_len", sequence_len, minimum=1)
        self.height, self.width = check_size_pair("image_size", image_size, minimum=2)
        self.traj_per_sample = check_int("traj_per_sample", traj_per_sample, minimum=1)
        seed = check_int("seed", seed, minimum=0)
        self.num_objects = check_int("num_objects", num_objects, minimum=0)
        first_clip = check_int("first_clip", first_clip, minimum=0)
        super().__init__(num_clips, seed, first_clip, unit="clips")

    def draw(self, rng: np.random.Generator, number: int) -> dict[str, Tensor]:
        """Clip number ``number``: its layers rendered, its points placed and ``traj_per_sample`` of them chosen."""
        layers = random_layers(rng, self.sequence_len, self.height, self.width, self.num_objects)
        video = render_layers(layers, self.height, self.width)
        candidates = _CANDIDATES_PER_TRACK * self.traj_per_sample
        tracks, owners = place_points(rng, layers, candidates, self.height, self.width)
        visibility = point_visibility(tracks, owners, layers, self.height, self.width)
        source = f"synthetic clip {number}"
        return tracking_sample(video, tracks.numpy(), visibility.numpy(), self.traj_per_sample, rng, source)


class SyntheticTrackingDataModule(LoaderDataModule):
    """Point-tracking data made of deterministic synthetic clips, for tests and benchmarks.

    Clips are rendered on the fly in ``__getitem__`` (see ``SyntheticTrackingDataset``), so any size
    costs no memory; validation clips are different draws from the training ones.

    Args:
        num_clips: training clips, at least 1.
        val_clips: validation clips, at least 0 (0: no validation).
        sequence_len: frames per clip, at least 2 (24 for CoTracker2, 64 for CoTracker3 online).
        image_size: ``(H, W)``, each at least 16 (the trackers work at 384 × 512).
        traj_per_sample: tracks per clip, at least 1.
        num_objects: moving shapes per clip, at least 0.
        seed: seed of the data, at least 0; the same seed gives the same clips.
        **kwargs: loader arguments of ``LoaderDataModule`` (``batch_size``, ``num_workers`` …).

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> dm = SyntheticTrackingDataModule(num_clips=2, val_clips=1, sequence_len=4, image_size=(32, 32),
        ...                                  traj_per_sample=6, batch_size=2)
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["video"].shape, batch["queries"].shape, batch["visibility"].dtype
        (torch.Size([2, 4, 3, 32, 32]), torch.Size([2, 6, 3]), torch.bool)
    """

    def __init__(
        self,
        num_clips: int = 256,
        val_clips: int = 8,
        sequence_len: int = 24,
        image_size: Sequence[int] = (384, 512),
        traj_per_sample: int = 256,
        num_objects: int = 3,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        num_clips = check_int("num_clips", num_clips, minimum=1)
        val_clips = check_int("val_clips", val_clips, minimum=0)
        sequence_len = check_int("sequence_len", sequence_len, minimum=2)
        size = check_size_pair("image_size", image_size, minimum=16)
        traj_per_sample = check_int("traj_per_sample", traj_per_sample, minimum=1)
        num_objects = check_int("num_objects", num_objects, minimum=0)
        seed = check_int("seed", seed, minimum=0)
        super().__init__(**kwargs)
        self.loader_options["collate_fn"] = collate_tracking_samples  # a size mismatch names the clips
        self.num_clips = num_clips
        self.val_clips = val_clips
        self.sequence_len = sequence_len
        self.image_size = size
        self.traj_per_sample = traj_per_sample
        self.num_objects = num_objects
        self.seed = seed

    def _clips(self, count: int, first_clip: int) -> SyntheticTrackingDataset:
        return SyntheticTrackingDataset(
            count, self.sequence_len, self.image_size, self.traj_per_sample, self.seed, self.num_objects, first_clip
        )

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return disjoint_ranges(self._clips, self.num_clips, self.val_clips)
