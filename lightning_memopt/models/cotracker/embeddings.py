"""Fixed (non-learned) sinusoidal embeddings of positions, times and motions, as the official CoTracker has them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def sincos_embedding(positions: Tensor, dim: int) -> Tensor:
    """Transformer-style sinusoidal embedding of scalar positions: ``[sin(p·ω_k)…, cos(p·ω_k)…]``.

    Frequencies are ``ω_k = 1 / 10000^(k / (dim/2))``; an odd ``dim`` drops the last cosine. Computed
    in float64 and returned in float32, so that tables match the official buffers bit for bit.

    Args:
        positions: [...] any real positions (frame indices, pixel coordinates).
        dim: size of the embedding.

    Returns:
        [..., dim] float32.

    Example::

        >>> sincos_embedding(torch.tensor([0.0, 1.0]), 4).shape
        torch.Size([2, 4])
        >>> sincos_embedding(torch.tensor([0.0]), 4).tolist()
        [[0.0, 0.0, 1.0, 1.0]]
    """
    half = (dim + 1) // 2
    exponents = torch.arange(half, device=positions.device, dtype=torch.float64) / (dim / 2.0)
    frequencies = 1.0 / torch.pow(10000.0, exponents)
    angles = positions.to(torch.float64)[..., None] * frequencies
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[..., :dim].float()


def sincos_embedding_2d(points: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of ``(x, y)`` points: ``dim // 2`` channels for x, the rest for y.

    Example::

        >>> sincos_embedding_2d(torch.zeros(3, 2), 456).shape
        torch.Size([3, 456])
    """
    return torch.cat([sincos_embedding(points[..., 0], dim // 2), sincos_embedding(points[..., 1], dim - dim // 2)], -1)


def grid_sincos_embedding_2d(points: Tensor, dim: int, grid_size: Sequence[int]) -> Tensor:
    """CoTracker2's position embedding: the :func:`sincos_embedding_2d` table of the integer grid of
    ``grid_size`` = ``(h, w)``, interpolated bilinearly at ``points`` (clamped to the grid, i.e. border padding).

    The x channels depend on x only and the y channels on y only, so the bilinear interpolation of the
    table is a linear interpolation per axis between the two neighbouring integer positions: no table
    is materialised.

    Args:
        points: [..., 2] ``(x, y)`` in grid pixels.
        dim: size of the embedding.
        grid_size: ``(h, w)`` of the integer grid (``model_resolution // stride``).

    Returns:
        [..., dim] float32.

    Example::

        >>> middle = grid_sincos_embedding_2d(torch.tensor([[2.25, 1.0]]), 8, (4, 4))
        >>> ends = sincos_embedding_2d(torch.tensor([[2.0, 1.0], [3.0, 1.0]]), 8)
        >>> torch.allclose(middle, 0.75 * ends[:1] + 0.25 * ends[1:])
        True
    """
    height, width = grid_size
    limits = torch.tensor([width - 1, height - 1], device=points.device, dtype=points.dtype)
    points = torch.minimum(points.clamp(min=0), limits)
    low = points.floor()
    high = torch.minimum(low + 1, limits)
    fraction = (points - low).float()[..., None]
    shape = (*points.shape[:-1], dim // 2)
    weight = torch.cat([fraction[..., 0, :].expand(shape), fraction[..., 1, :].expand(*shape[:-1], dim - dim // 2)], -1)
    return torch.lerp(sincos_embedding_2d(low, dim), sincos_embedding_2d(high, dim), weight)


def flow_embedding(flow: Tensor, dim_per_axis: int = 64) -> Tensor:
    """CoTracker2's flow embedding: the raw ``(dx, dy)``, then per axis ``sin(d·f_k), cos(d·f_k)`` interleaved.

    Frequencies are ``f_k = 2k · 1000 / dim_per_axis`` for ``k < dim_per_axis / 2``; channel ``2k`` of an
    axis holds the sine, ``2k + 1`` the cosine.

    Args:
        flow: [..., 2] displacements ``(dx, dy)``.
        dim_per_axis: sinusoidal channels per axis (even).

    Returns:
        [..., 2 + 2·dim_per_axis] (130 for the default 64): ``[dx, dy, x channels, y channels]``.

    Example::

        >>> flow_embedding(torch.zeros(5, 2)).shape
        torch.Size([5, 130])
        >>> flow_embedding(torch.zeros(1, 2), 4)[0].tolist()
        [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    """
    frequencies = torch.arange(0, dim_per_axis, 2, device=flow.device, dtype=flow.dtype) * (1000.0 / dim_per_axis)
    angles = flow[..., None] * frequencies  # [..., 2, dim_per_axis / 2]
    waves = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-3)  # x then y, sine and cosine interleaved
    return torch.cat([flow, waves], dim=-1)


def fourier_encoding(values: Tensor, min_degree: int = 0, max_degree: int = 10) -> Tensor:
    """CoTracker3's motion encoding: ``[v, sin(v·2^k), cos(v·2^k)]`` for ``k`` in ``[min_degree, max_degree)``.

    The sines (and the cosines) are ordered degree by degree, all values of a degree together:
    channel ``D + k·D + i`` is ``sin(v_i · 2^(min_degree + k))``.

    Returns:
        [..., D · (1 + 2·(max_degree − min_degree))]: 84 for the 4 relative-motion values and degrees 0…9.

    Example::

        >>> fourier_encoding(torch.zeros(2, 4)).shape
        torch.Size([2, 84])
        >>> [round(v, 4) for v in fourier_encoding(torch.tensor([0.5, 1.0]), 0, 2)[2:6].tolist()]
        [0.4794, 0.8415, 0.8415, 0.9093]
    """
    scales = 2.0 ** torch.arange(min_degree, max_degree, device=values.device, dtype=values.dtype)
    angles = (values[..., None, :] * scales[:, None]).flatten(-2)  # [..., degrees·D], degree outer
    return torch.cat([values, angles.sin(), angles.cos()], dim=-1)
