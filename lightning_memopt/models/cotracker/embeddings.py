"""Fixed (non-learned) sinusoidal embeddings of positions, times and motions."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sincos_embedding(positions: Tensor, dim: int) -> Tensor:
    """Transformer-style sinusoidal embedding of scalar positions: ``[sin(p·ω_k), cos(p·ω_k)]``.

    Frequencies are ``ω_k = 10000^(−2k/dim)``; an odd ``dim`` drops the last cosine.

    Args:
        positions: [...] any real positions (frame indices, pixel coordinates).
        dim: size of the embedding.

    Returns:
        [..., dim].

    Example::

        >>> sincos_embedding(torch.tensor([0.0, 1.0]), 4).shape
        torch.Size([2, 4])
        >>> sincos_embedding(torch.tensor([0.0]), 4).tolist()
        [[0.0, 0.0, 1.0, 1.0]]
    """
    half = (dim + 1) // 2
    frequencies = torch.exp(torch.arange(half, device=positions.device) * (-2.0 * math.log(10000.0) / dim))
    angles = positions.float()[..., None] * frequencies
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[..., :dim]


def sincos_embedding_2d(points: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of ``(x, y)`` points: ``dim // 2`` channels for x, the rest for y.

    Example::

        >>> sincos_embedding_2d(torch.zeros(3, 2), 456).shape
        torch.Size([3, 456])
    """
    return torch.cat([sincos_embedding(points[..., 0], dim // 2), sincos_embedding(points[..., 1], dim - dim // 2)], -1)


def flow_embedding(flow: Tensor, dim_per_axis: int = 64) -> Tensor:
    """CoTracker2's flow embedding: the raw ``(dx, dy)`` followed by a sinusoidal embedding of each.

    Returns:
        [..., 2 + 2·dim_per_axis] (130 for the default 64).

    Example::

        >>> flow_embedding(torch.zeros(5, 2)).shape
        torch.Size([5, 130])
    """
    return torch.cat(
        [flow, sincos_embedding(flow[..., 0], dim_per_axis), sincos_embedding(flow[..., 1], dim_per_axis)], -1
    )


def fourier_encoding(values: Tensor, min_degree: int = 0, max_degree: int = 10) -> Tensor:
    """CoTracker3's motion encoding: ``[v, sin(v·2^k), cos(v·2^k)]`` for ``k`` in ``[min_degree, max_degree)``.

    Returns:
        [..., D · (1 + 2·(max_degree − min_degree))]: 84 for the 4 relative-motion values and degrees 0…9.

    Example::

        >>> fourier_encoding(torch.zeros(2, 4)).shape
        torch.Size([2, 84])
    """
    scales = 2.0 ** torch.arange(min_degree, max_degree, device=values.device, dtype=values.dtype)
    angles = (values[..., None] * scales).flatten(-2)  # [..., D·degrees]
    return torch.cat([values, angles.sin(), angles.cos()], dim=-1)
