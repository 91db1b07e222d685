"""Synthetic point-tracking clips: textured layers moving along known paths, with exact tracks and occlusions.

A clip is a stack of layers drawn back to front: a textured background larger than the frame that
pans slowly, then ``num_objects`` textured rectangles and ellipses, each moving along a path
``c(t) = c₀ + v·t + a·sin(ω·t + φ)``. A point is fixed on one layer at local coordinates ``(u, v)``, so
its track is exact; it is visible where it lies inside the frame and no nearer layer covers it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import check_int
from lightning_memopt.data.checks import check_size_pair
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.tracking_sample import collate_tracking_samples, tracking_sample

_TEXTURE_CELLS = 12  # a layer's texture: a 12 × 12 grid of random colours plus a coarse 3 × 3 tint
_BACKGROUND_SCALE = 1.25  # the background extends 25 % past every edge of the frame …
_BACKGROUND_DRIFT = 0.2  # … and moves by at most 20 % of the half frame over a clip: it always covers it
_CANDIDATES_PER_TRACK = 2  # points placed per track asked for, before the visible ones are chosen


@dataclass(frozen=True)
class Layer:
    """A textured shape moving through a clip.

    Attributes:
        centres: ``[T, 2]`` centre ``(x, y)`` in pixels in every frame.
        half_size: ``(half width, half height)`` in pixels.
        ellipse: an ellipse inscribed in the box, else the whole box.
        texture: ``[3, cells, cells]`` colours in [0, 255], stretched over the box.
    """

    centres: Tensor
    half_size: Tensor
    ellipse: bool
    texture: Tensor

    def local(self, points: Tensor) -> Tensor:
        """Pixel positions ``[T, ..., 2]`` → box coordinates in [-1, 1] (``[T, ..., 2]``)."""
        shape = (self.centres.shape[0],) + (1,) * (points.dim() - 2) + (2,)
        return (points - self.centres.view(shape)) / self.half_size

    def covers(self, local: Tensor) -> Tensor:
        """Whether box coordinates ``[..., 2]`` lie on the shape."""
        if self.ellipse:
            return local.square().sum(dim=-1) <= 1.0
        return local.abs().amax(dim=-1) <= 1.0


def _random_texture(rng: np.random.Generator) -> Tensor:
    coarse = torch.from_numpy(rng.uniform(0.0, 255.0, size=(1, 3, 3, 3))).float()
    tint = F.interpolate(coarse, size=(_TEXTURE_CELLS, _TEXTURE_CELLS), mode="bilinear", align_corners=True)[0]
    detail = torch.from_numpy(rng.uniform(-80.0, 80.0, size=(3, _TEXTURE_CELLS, _TEXTURE_CELLS))).float()
    return (tint + detail).clamp(0.0, 255.0)


def _path(rng: np.random.Generator, start: np.ndarray, speed: float, wobble: float, num_frames: int) -> Tensor:
    """``[T, 2]`` positions ``start + v·t + a·sin(ω·t + φ)`` with ``|v| ≤ speed`` and ``|a| ≤ wobble`` per axis."""
    t = np.arange(num_frames, dtype=np.float64)[:, None]
    velocity = rng.uniform(-speed, speed, size=2)
    amplitude, frequency, phase = rng.uniform(0, wobble, size=2), rng.uniform(0.3, 1.0, 2), rng.uniform(0, 6.3, 2)
    path = start + velocity * t + amplitude * np.sin(frequency * t + phase) - amplitude * np.sin(phase)
    return torch.from_numpy(path).float()


def random_layers(rng: np.random.Generator, num_frames: int, height: int, width: int, num_objects: int) -> list[Layer]:
    """A panning background and ``num_objects`` moving shapes, back to front.

    Example::

        >>> layers = random_layers(np.random.default_rng(0), num_frames=8, height=64, width=64, num_objects=2)
        >>> len(layers), tuple(layers[1].centres.shape)
        (3, (8, 2))
    """
    frame_half = np.array([(width - 1) / 2, (height - 1) / 2])
    drift = _BACKGROUND_DRIFT * frame_half.min() / max(num_frames - 1, 1)
    background = Layer(
        centres=_path(rng, frame_half, speed=drift / 2, wobble=drift / 4, num_frames=num_frames),
        half_size=torch.tensor(frame_half * _BACKGROUND_SCALE).float(),
        ellipse=False,
        texture=_random_texture(rng),
    )
    layers = [background]
    size = min(height, width)
    for _ in range(num_objects):
        start = rng.uniform([0, 0], [width - 1, height - 1])
        half_size = torch.from_numpy(rng.uniform(0.1 * size, 0.22 * size, size=2)).float()
        path = _path(rng, start, speed=0.04 * size, wobble=0.05 * size, num_frames=num_frames)
        layers.append(Layer(path, half_size, ellipse=bool(rng.integers(2)), texture=_random_texture(rng)))
    return layers


def render_layers(layers: Sequence[Layer], height: int, width: int) -> Tensor:
    """Draw the layers back to front: ``[T, 3, H, W]`` float32 in [0, 255].

    Example::

        >>> layers = random_layers(np.random.default_rng(0), num_frames=4, height=16, width=24, num_objects=1)
        >>> video = render_layers(layers, 16, 24)
        >>> video.shape, bool(video.min() >= 0 and video.max() <= 255)
        (torch.Size([4, 3, 16, 24]), True)
    """
    rows, cols = torch.meshgrid(
        torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32), indexing="ij"
    )
    pixels = torch.stack([cols, rows], dim=-1)[None]  # 1 H W 2
    video = torch.zeros(layers[0].centres.shape[0], 3, height, width)
    for layer in layers:
        local = layer.local(pixels)  # T H W 2
        texture = layer.texture[None].expand(local.shape[0], -1, -1, -1)
        colour = F.grid_sample(texture, local, mode="bilinear", padding_mode="border", align_corners=True)
        video = torch.where(layer.covers(local)[:, None], colour, video)
    return video


def place_points(
    rng: np.random.Generator, layers: Sequence[Layer], count: int, height: int, width: int
) -> tuple[Tensor, Tensor]:
    """Fix ``count`` points on random layers: their tracks ``[T, count, 2]`` and owning layers ``[count]``.

    A background point starts anywhere in the first frame; an object point anywhere well inside its
    shape.

    Example::

        >>> layers = random_layers(np.random.default_rng(0), num_frames=8, height=64, width=64, num_objects=2)
        >>> tracks, owners = place_points(np.random.default_rng(1), layers, 10, 64, 64)
        >>> tuple(tracks.shape), tuple(owners.shape)
        ((8, 10, 2), (10,))
    """
    owners = torch.from_numpy(rng.integers(len(layers), size=count))
    tracks = torch.empty(layers[0].centres.shape[0], count, 2)
    for index, layer in enumerate(layers):
        chosen = torch.nonzero(owners == index)[:, 0]
        if index == 0:  # anywhere in the first frame, in the background's coordinates
            start = torch.from_numpy(rng.uniform([0, 0], [width - 1, height - 1], size=(len(chosen), 2))).float()
            local = layer.local(start[None])[0]
        else:
            local = torch.from_numpy(rng.uniform(-0.7, 0.7, size=(len(chosen), 2))).float()
        tracks[:, chosen] = layer.centres[:, None] + local * layer.half_size
    return tracks, owners


def point_visibility(tracks: Tensor, owners: Tensor, layers: Sequence[Layer], height: int, width: int) -> Tensor:
    """``[T, M]``: whether each point lies in the frame and no layer nearer than its own covers it.

    Args:
        tracks: ``[T, M, 2]`` positions in pixels.
        owners: ``[M]`` index of each point's layer in ``layers`` (back to front).
        layers: the clip's layers.
        height: frame rows.
        width: frame columns.

    Example::

        >>> still = torch.tensor([[8.0, 8.0]])
        >>> background = Layer(still, torch.tensor([10.0, 10.0]), False, torch.zeros(3, 2, 2))
        >>> square = Layer(still, torch.tensor([2.0, 2.0]), False, torch.zeros(3, 2, 2))
        >>> tracks = torch.tensor([[[8.0, 8.0], [1.0, 1.0], [8.0, 8.0], [-1.0, 3.0]]])
        >>> point_visibility(tracks, torch.tensor([0, 0, 1, 0]), [background, square], 16, 16).tolist()
        [[False, True, True, False]]
    """
    limits = torch.tensor([width - 1, height - 1], dtype=tracks.dtype)
    visibility = ((tracks >= 0) & (tracks <= limits)).all(dim=-1)
    for index, layer in enumerate(layers[1:], start=1):
        visibility &= ~(layer.covers(layer.local(tracks)) & (owners < index))
    return visibility


class SyntheticTrackingDataset(Dataset):
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
        self.num_clips = check_int("num_clips", num_clips, minimum=0)
        self.sequence_len = check_int("sequence_len", sequence_len, minimum=1)
        self.height, self.width = check_size_pair("image_size", image_size, minimum=2)
        self.traj_per_sample = check_int("traj_per_sample", traj_per_sample, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.num_objects = check_int("num_objects", num_objects, minimum=0)
        self.first_clip = check_int("first_clip", first_clip, minimum=0)

    def __len__(self) -> int:
        return self.num_clips

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= operator.index(index) < self.num_clips:
            raise IndexError(f"index {index!r} out of range for a dataset of {self.num_clips} clips")
        rng = np.random.default_rng([self.seed, self.first_clip + operator.index(index)])
        layers = random_layers(rng, self.sequence_len, self.height, self.width, self.num_objects)
        video = render_layers(layers, self.height, self.width)
        candidates = _CANDIDATES_PER_TRACK * self.traj_per_sample
        tracks, owners = place_points(rng, layers, candidates, self.height, self.width)
        visibility = point_visibility(tracks, owners, layers, self.height, self.width)
        source = f"synthetic clip {self.first_clip + operator.index(index)}"
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
        return self._clips(self.num_clips, 0), self._clips(self.val_clips, self.num_clips) if self.val_clips else None
