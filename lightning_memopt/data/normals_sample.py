"""The sample format of the surface-normal datasets: normalised image, unit normals, validity mask.

A sample is a dict of three tensors:

- ``image``: float32 ``[3, H, W]``, RGB in [0, 1] normalised with the ImageNet mean and std (the
  normalisation of the Sapiens pre-training);
- ``normal``: float32 ``[3, H, W]``, unit vectors in camera coordinates, x right, y up, z towards the
  camera (a surface facing the camera has normal (0, 0, 1)); zero outside the mask;
- ``mask``: bool ``[1, H, W]``, True where the normal is defined.
"""

from __future__ import annotations

import torch
from torch import Tensor

IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


def normals_sample(image: Tensor, normal: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Assemble a sample from an RGB image in [0, 1], a normal map and a validity mask.

    Args:
        image: float ``[3, H, W]`` in [0, 1].
        normal: float ``[3, H, W]``, unit vectors where ``mask`` is True (zeroed elsewhere).
        mask: bool ``[H, W]`` or ``[1, H, W]``.

    Example::

        >>> mask = torch.tensor([[True, False], [True, True]])
        >>> sample = normals_sample(torch.ones(3, 2, 2), torch.ones(3, 2, 2), mask)
        >>> [round(v, 4) for v in sample["image"][:, 0, 0].tolist()], sample["normal"][:, 0, 1].tolist()
        ([2.2489, 2.4286, 2.64], [0.0, 0.0, 0.0])
        >>> sample["mask"].shape
        torch.Size([1, 2, 2])
    """
    mask = mask.reshape(1, *normal.shape[-2:]).bool()
    mean = torch.tensor(IMAGE_MEAN, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, dtype=torch.float32).view(3, 1, 1)
    return {
        "image": (image.float() - mean) / std,
        "normal": normal.float().masked_fill(~mask, 0.0),
        "mask": mask,
    }
