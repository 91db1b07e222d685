"""Synthetic surface normals: analytic scenes (planes, spheres, boxes) ray-cast on the fly with exact normals.

A scene is an optional tilted background plane and 1 … ``max_objects`` objects (spheres, boxes seen
at a random angle, tilted discs), cast by orthographic rays along −z in camera coordinates (x right,
y up, z towards the camera; :mod:`lightning_memopt.data.raycast`). The nearest surface of every
pixel gives the exact unit normal; pixels that no surface covers are invalid. The image is
Lambertian shading under a random light of each surface's colour and stripe texture, so it carries
the normal information.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import check_int
from lightning_memopt.data.checks import check_size_pair
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.normals_folder import normals_sample
from lightning_memopt.data.raycast import Surface, box, disc, pixel_coordinates, random_rotation, shade, sphere
from lightning_memopt.data.resumable import SeededDataset, disjoint_ranges

_BACKGROUND_DEPTH = -1.5  # the background plane passes through (0, 0, -1.5), behind the objects
_BACKGROUND_PROBABILITY = 0.75  # without a background plane, uncovered pixels are invalid
_NOISE_STD = 0.01


def _random_facing_normal(rng: np.random.Generator, max_slope: float) -> tuple[float, float, float]:
    """A unit normal ``∝ (a, b, 1)`` with ``|a|, |b| ≤ max_slope``: it faces the camera."""
    a, b = rng.uniform(-max_slope, max_slope, size=2)
    norm = math.sqrt(a * a + b * b + 1.0)
    return a / norm, b / norm, 1.0 / norm


def _random_object(rng: np.random.Generator, x: np.ndarray, y: np.ndarray) -> Surface:
    """One random object: a sphere, a box seen at an angle, or a tilted disc, in front of the background."""
    center = (*rng.uniform(-0.6, 0.6, size=2), rng.uniform(-0.4, 0.4))
    kind = rng.integers(3)
    if kind == 0:
        return sphere(x, y, center, radius=rng.uniform(0.2, 0.45))
    if kind == 1:
        return box(x, y, center, half_size=tuple(rng.uniform(0.12, 0.3, size=3)), rotation=random_rotation(rng))
    return disc(x, y, center, normal=_random_facing_normal(rng, max_slope=1.0), radius=rng.uniform(0.2, 0.5))


def render_scene(rng: np.random.Generator, height: int, width: int, max_objects: int = 3) -> tuple[Tensor, ...]:
    """Draw and ray-cast one random scene.

    Args:
        rng: the source of every random choice (the same state gives the same scene).
        height: image rows.
        width: image columns.
        max_objects: the scene holds 1 … ``max_objects`` objects.

    Returns:
        ``(image, normal, mask)`` as float32 tensors: RGB ``[3, H, W]`` in [0, 1], unit normals
        ``[3, H, W]`` (zero where invalid) and bool ``[H, W]``.

    Example::

        >>> image, normal, mask = render_scene(np.random.default_rng(0), 24, 32)
        >>> image.shape, bool(torch.allclose(normal.norm(dim=0)[mask], torch.ones(int(mask.sum()))))
        (torch.Size([3, 24, 32]), True)
    """
    x, y = pixel_coordinates(height, width)
    surfaces = [_random_object(rng, x, y) for _ in range(rng.integers(1, max_objects + 1))]
    if rng.random() < _BACKGROUND_PROBABILITY:
        background = _random_facing_normal(rng, max_slope=0.3)
        surfaces.append(disc(x, y, (0.0, 0.0, _BACKGROUND_DEPTH), background, radius=math.inf))
    depth = np.full((height, width), -np.inf)
    normal = np.zeros((3, height, width))
    albedo = np.zeros((3, height, width))
    for surface in surfaces:
        colour = rng.uniform(0.25, 1.0, size=(3, 1, 1))
        frequency, angle, phase = rng.uniform(4.0, 12.0), rng.uniform(0.0, math.pi), rng.uniform(0.0, 2 * math.pi)
        stripes = 1.0 + 0.15 * np.sin(frequency * (x * math.cos(angle) + y * math.sin(angle)) + phase)
        nearer = surface.hit & (surface.depth > depth)
        depth = np.where(nearer, surface.depth, depth)
        normal = np.where(nearer, surface.normal, normal)
        albedo = np.where(nearer, colour * stripes, albedo)
    shaded = shade(normal, albedo, light=_random_facing_normal(rng, max_slope=1.0))
    image = np.clip(shaded + rng.normal(0.0, _NOISE_STD, size=(3, height, width)), 0.0, 1.0)
    mask = np.isfinite(depth)
    normal /= np.maximum(np.linalg.norm(normal, axis=0), 1e-12)
    return torch.from_numpy(image).float(), torch.from_numpy(normal).float(), torch.from_numpy(mask)


class SyntheticNormalsDataset(SeededDataset):
    """``num_samples`` random scenes; scene ``i`` depends on ``(seed, first_index + i)`` only and is
    rendered when it is read (see :func:`render_scene`), as a sample dict of ``normals_sample``.

    Args:
        num_samples: number of scenes.
        image_size: ``(H, W)`` of the images.
        seed: seed of the whole dataset, at least 0.
        first_index: number of the first scene, so that datasets with non-overlapping ranges
            (train and validation) hold different scenes.
        max_objects: each scene holds 1 … ``max_objects`` objects.

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> dataset = SyntheticNormalsDataset(num_samples=3, image_size=(24, 32), seed=0)
        >>> sample = dataset[2]
        >>> sample["normal"].shape, torch.equal(sample["image"], dataset[2]["image"])
        (torch.Size([3, 24, 32]), True)
    """

    def __init__(
        self, num_samples: int, image_size: Sequence[int], seed: int, first_index: int = 0, max_objects: int = 3
    ) -> None:
        num_samples = check_int("num_samples", num_samples, minimum=0)
        self.height, self.width = check_size_pair("image_size", image_size, minimum=1)
        seed = check_int("seed", seed, minimum=0)
        first_index = check_int("first_index", first_index, minimum=0)
        self.max_objects = check_int("max_objects", max_objects, minimum=1)
        super().__init__(num_samples, seed, first_index, unit="samples")

    def draw(self, rng: np.random.Generator, number: int) -> dict[str, Tensor]:
        """Scene number ``number``, rendered."""
        return normals_sample(*render_scene(rng, self.height, self.width, self.max_objects))


class SyntheticNormalsDataModule(LoaderDataModule):
    """Surface-normal data made of deterministic synthetic scenes, for tests and benchmarks.

    Scenes are rendered on the fly in ``__getitem__`` (see ``SyntheticNormalsDataset``), so any size
    costs no memory; validation scenes are different draws from the training ones.

    Args:
        num_samples: training scenes, at least 1.
        val_samples: validation scenes, at least 0 (0: no validation).
        image_size: ``(H, W)``, each at least 8 (the Sapiens input is 1024 × 768).
        max_objects: each scene holds 1 … ``max_objects`` objects, at least 1.
        seed: seed of the data, at least 0; the same seed gives the same scenes.
        **kwargs: loader arguments of ``LoaderDataModule`` (``batch_size``, ``num_workers`` …).

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> dm = SyntheticNormalsDataModule(num_samples=4, val_samples=2, image_size=(32, 24), batch_size=2)
        >>> batch = next(iter(dm.val_dataloader()))
        >>> batch["image"].shape, batch["mask"].dtype, len(dm.train_dataset)
        (torch.Size([2, 3, 32, 24]), torch.bool, 4)
    """

    def __init__(
        self,
        num_samples: int = 256,
        val_samples: int = 16,
        image_size: Sequence[int] = (1024, 768),
        max_objects: int = 3,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        num_samples = check_int("num_samples", num_samples, minimum=1)
        val_samples = check_int("val_samples", val_samples, minimum=0)
        size = check_size_pair("image_size", image_size, minimum=8)
        max_objects = check_int("max_objects", max_objects, minimum=1)
        seed = check_int("seed", seed, minimum=0)
        super().__init__(**kwargs)
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.image_size = size
        self.max_objects = max_objects
        self.seed = seed

    def _scenes(self, count: int, first_index: int) -> SyntheticNormalsDataset:
        return SyntheticNormalsDataset(count, self.image_size, self.seed, first_index, self.max_objects)

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return disjoint_ranges(self._scenes, self.num_samples, self.val_samples)
