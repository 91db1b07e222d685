"""Textured layers moving along known paths: drawing them back to front, and points fixed on them with exact tracks.

A clip's layers are a textured background larger than the frame that pans slowly, then textured
rectangles and ellipses, each moving along a path ``c(t) = c₀ + v·t + a·sin(ω·t + φ)``. A point is
fixed on one layer at local coordinates ``(u, v)``, so its track is exact; it is visible where it lies
inside the frame and no nearer layer covers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

_TEXTURE_CELLS = 12  # a layer's texture: a 12 × 12 grid of random colours plus a coarse 3 × 3 tint
_BACKGROUND_SCALE = 1.25  # the background extends 25 % past every edge of the frame …
_BACKGROUND_DRIFT = 0.2  # … and moves by at most 20 % of the half frame over a clip: it always covers it


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
