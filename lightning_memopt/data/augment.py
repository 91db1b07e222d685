"""Per-sample augmentation of face crops in plain torch: flip, small rotation, colour jitter."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_memopt.arguments import check_float, check_fraction

# ITU-R BT.601 luma weights, the usual choice for "grayscale" in saturation/contrast jitter.
_LUMA = (0.299, 0.587, 0.114)


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    """Draw one float uniformly from ``[low, high]`` with ``generator`` (``None``: torch's global RNG)."""
    return low + (high - low) * float(torch.rand((), generator=generator))


def _rotate(image: Tensor, degrees: float) -> Tensor:
    """Rotate a CHW image about its centre; pixels from outside the image are 0."""
    _, height, width = image.shape
    angle = math.radians(degrees)
    cos, sin = math.cos(angle), math.sin(angle)
    # affine_grid works in [-1, 1] coordinates per axis; the aspect terms keep the rotation rigid
    # in pixel space for non-square images.
    theta = torch.tensor(
        [[cos, sin * height / width, 0.0], [-sin * width / height, cos, 0.0]],
        dtype=image.dtype,
        device=image.device,
    )
    grid = F.affine_grid(theta[None], [1, *image.shape], align_corners=False)
    return F.grid_sample(image[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]


def _grayscale(image01: Tensor) -> Tensor:
    """Luma of a CHW RGB image in [0, 1], shaped [1, H, W]."""
    weights = torch.tensor(_LUMA, dtype=image01.dtype, device=image01.device).view(3, 1, 1)
    return (image01 * weights).sum(dim=0, keepdim=True)


def _color_jitter(image: Tensor, strength: float, generator: torch.Generator | None) -> Tensor:
    """Scale brightness, contrast and saturation of a [-1, 1] image by factors in [1-s, 1+s]."""
    low, high = 1.0 - strength, 1.0 + strength
    image01 = (image + 1.0) * 0.5
    image01 = image01 * _uniform(low, high, generator)
    mean = _grayscale(image01).mean()
    image01 = mean + (image01 - mean) * _uniform(low, high, generator)
    gray = _grayscale(image01)
    image01 = gray + (image01 - gray) * _uniform(low, high, generator)
    return (image01 * 2.0 - 1.0).clamp_(-1.0, 1.0)


class FaceAugmentation:
    """Random flip, rotation and colour jitter of one face image (CHW float in [-1, 1]).

    Every transform is off when its argument is 0. Randomness comes from the ``generator`` of each call
    (the face datamodules seed one per sample from the run's seed, the epoch and the index, so a run and
    its resumption augment alike, workers or not), else from torch's global RNG.

    Args:
        hflip: probability of a horizontal flip, in [0, 1].
        rotation_degrees: rotate by an angle drawn uniformly from [-deg, deg], in [0, 180];
            pixels rotated in from outside the image are 0.
        color_jitter: scale brightness, contrast and saturation each by a factor drawn uniformly
            from [1 - j, 1 + j], in [0, 1); the result is clamped to [-1, 1].

    Raises:
        ValueError: an argument is outside its range (or not finite).
        TypeError: an argument is not a number.

    Example::

        >>> augment = FaceAugmentation(hflip=1.0)
        >>> image = torch.rand(3, 8, 8) * 2 - 1
        >>> torch.equal(augment(image), image.flip(-1))
        True
        >>> FaceAugmentation(hflip=0.0).is_identity
        True
    """

    def __init__(self, hflip: float = 0.5, rotation_degrees: float = 0.0, color_jitter: float = 0.0) -> None:
        self.hflip = check_float("hflip", hflip, minimum=0, maximum=1)
        self.rotation_degrees = check_float("rotation_degrees", rotation_degrees, minimum=0, maximum=180)
        self.color_jitter = check_fraction("color_jitter", color_jitter, open_maximum=True)

    @property
    def is_identity(self) -> bool:
        """True when every transform is off, so calling the augmentation changes nothing."""
        return self.hflip == 0.0 and self.rotation_degrees == 0.0 and self.color_jitter == 0.0

    def to_dict(self) -> dict[str, float]:
        """The constructor arguments, e.g. for ``save_hyperparameters`` or a config file."""
        return {
            "hflip": self.hflip,
            "rotation_degrees": self.rotation_degrees,
            "color_jitter": self.color_jitter,
        }

    def __call__(self, image: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Augment one CHW image; returns a new tensor or ``image`` itself when nothing applies.

        Args:
            image: CHW tensor with 3 channels in [-1, 1].
            generator: the source of every random draw; ``None`` means torch's global RNG.

        Raises:
            ValueError: ``image`` is not a 3-channel CHW tensor.
        """
        if image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"`image` must be a CHW tensor with 3 channels, got shape {tuple(image.shape)}")
        if self.hflip > 0.0 and float(torch.rand((), generator=generator)) < self.hflip:
            image = image.flip(-1)
        if self.rotation_degrees > 0.0:
            image = _rotate(image, _uniform(-self.rotation_degrees, self.rotation_degrees, generator))
        if self.color_jitter > 0.0:
            image = _color_jitter(image, self.color_jitter, generator)
        return image

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.to_dict().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, FaceAugmentation):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable attributes, so not hashable
