"""Orthographic ray casting of analytic surfaces (spheres, discs, boxes) with exact normals, and Lambertian shading.

Rays run along −z in camera coordinates (x right, y up, z towards the camera), one per pixel
centre (:func:`pixel_coordinates`); each surface says where it is hit, at what depth (larger is
nearer) and with what unit normal (:class:`Surface`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_RAY_ORIGIN_Z = 10.0  # rays start in front of every surface of a scene
_AMBIENT = 0.3


@dataclass(frozen=True)
class Surface:
    """Where a surface is seen: ``hit`` ``[H, W]``, ``depth`` (z, larger is nearer), unit ``normal`` ``[3, H, W]``."""

    hit: np.ndarray
    depth: np.ndarray
    normal: np.ndarray


def pixel_coordinates(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``, each ``[H, W]``: pixel centres with y from about 1 (top row) to −1, x scaled alike.

    Example::

        >>> x, y = pixel_coordinates(2, 4)
        >>> x[0].tolist(), y[:, 0].tolist()
        ([-1.5, -0.5, 0.5, 1.5], [0.5, -0.5])
    """
    rows = 1.0 - (2.0 * np.arange(height) + 1.0) / height
    cols = ((2.0 * np.arange(width) + 1.0) / width - 1.0) * (width / height)
    x, y = np.meshgrid(cols, rows)
    return x, y


def sphere(x: np.ndarray, y: np.ndarray, center: Sequence[float], radius: float) -> Surface:
    """The front of a sphere: normal ``(p − c) / r`` at the visible point ``p``.

    Example::

        >>> s = sphere(np.array([[0.0, 0.6]]), np.array([[0.0, 0.0]]), center=(0.0, 0.0, 0.0), radius=1.0)
        >>> s.hit.tolist(), s.depth.tolist(), s.normal[:, 0, 1].tolist()
        ([[True, True]], [[1.0, 0.8]], [0.6, 0.0, 0.8])
    """
    dx, dy = x - center[0], y - center[1]
    dz_squared = radius**2 - dx**2 - dy**2
    dz = np.sqrt(np.maximum(dz_squared, 0.0))
    return Surface(dz_squared > 0, center[2] + dz, np.stack([dx, dy, dz]) / radius)


def disc(x: np.ndarray, y: np.ndarray, center: Sequence[float], normal: Sequence[float], radius: float) -> Surface:
    """A flat disc through ``center`` with unit ``normal`` (``normal[2] > 0``); ``radius=inf`` is a whole plane.

    Example::

        >>> d = disc(np.array([[0.0, 2.0]]), np.array([[0.0, 0.0]]), (0.0, 0.0, -1.0), (0.0, 0.0, 1.0), radius=1.0)
        >>> d.hit.tolist(), d.depth.tolist()
        ([[True, False]], [[-1.0, -1.0]])
    """
    nx, ny, nz = normal
    dx, dy = x - center[0], y - center[1]
    dz = -(nx * dx + ny * dy) / nz
    hit = dx**2 + dy**2 + dz**2 < radius**2
    return Surface(hit, center[2] + dz, np.broadcast_to(np.reshape(normal, (3, 1, 1)), (3, *x.shape)))


def box(
    x: np.ndarray, y: np.ndarray, center: Sequence[float], half_size: Sequence[float], rotation: np.ndarray
) -> Surface:
    """A box with half extents ``half_size`` along the columns of ``rotation`` (3 × 3), ray-cast by slabs.

    The normal of a pixel is that of the face the ray enters: a column of ``rotation``, signed to
    face the camera, so the normals are piecewise constant.

    Example::

        >>> b = box(np.array([[0.0, 0.9]]), np.array([[0.0, 0.0]]), (0.0, 0.0, 0.0), (0.5, 0.5, 0.5), np.eye(3))
        >>> b.hit.tolist(), b.depth[0, 0].item(), b.normal[:, 0, 0].tolist()
        ([[True, False]], 0.5, [0.0, 0.0, 1.0])
    """
    origin = np.stack([x - center[0], y - center[1], np.full_like(x, _RAY_ORIGIN_Z - center[2])])
    local_origin = np.einsum("ji,jhw->ihw", rotation, origin)  # rotationᵀ · (origin − centre)
    local_direction = -rotation[2]  # rotationᵀ · (0, 0, −1)
    safe_direction = np.where(np.abs(local_direction) < 1e-12, 1e-12, local_direction).reshape(3, 1, 1)
    half = np.reshape(half_size, (3, 1, 1))
    t_low, t_high = (-half - local_origin) / safe_direction, (half - local_origin) / safe_direction
    t_entry = np.minimum(t_low, t_high)
    axis = t_entry.argmax(axis=0)
    t_near = np.take_along_axis(t_entry, axis[None], axis=0)[0]
    t_far = np.maximum(t_low, t_high).min(axis=0)
    facing = -np.sign(safe_direction.reshape(3))
    normal = (rotation * facing)[:, axis]  # column `axis` of the rotation, signed towards the camera
    return Surface(t_near < t_far, _RAY_ORIGIN_Z - t_near, normal)


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random 3 × 3 rotation matrix (from a random unit quaternion).

    Example::

        >>> r = random_rotation(np.random.default_rng(0))
        >>> bool(np.allclose(r @ r.T, np.eye(3))), round(float(np.linalg.det(r)), 6)
        (True, 1.0)
    """
    quaternion = rng.normal(size=4)
    w, i, j, k = quaternion / np.linalg.norm(quaternion)
    return np.array(
        [
            [1 - 2 * (j * j + k * k), 2 * (i * j - k * w), 2 * (i * k + j * w)],
            [2 * (i * j + k * w), 1 - 2 * (i * i + k * k), 2 * (j * k - i * w)],
            [2 * (i * k - j * w), 2 * (j * k + i * w), 1 - 2 * (i * i + j * j)],
        ]
    )


def shade(normal: np.ndarray, albedo: np.ndarray, light: Sequence[float]) -> np.ndarray:
    """Lambertian shading: ``albedo · (ambient + (1 − ambient) · max(0, n · l))`` with ambient 0.3.

    Args:
        normal: unit normals ``[3, H, W]``.
        albedo: RGB reflectance ``[3, H, W]``.
        light: unit direction towards the light.

    Example::

        >>> normal = np.array([[[0.0, 0.0]], [[0.0, 1.0]], [[1.0, 0.0]]])  # facing z, facing y
        >>> shade(normal, np.ones((3, 1, 2)), light=(0.0, 0.0, 1.0))[0].tolist()
        [[1.0, 0.3]]
    """
    lit = np.maximum(np.tensordot(np.asarray(light), normal, axes=1), 0.0)
    return albedo * (_AMBIENT + (1.0 - _AMBIENT) * lit)
