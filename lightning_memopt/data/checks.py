"""Checks of the data arguments that :mod:`lightning_memopt.arguments` does not cover: sizes, folders, splits.

The messages have the shape of :mod:`lightning_memopt.arguments`: the argument's name, the bad value and
what is valid; ``TypeError`` for a value of the wrong kind, ``ValueError`` for one out of range.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_memopt.arguments import check_fraction, check_int, check_path


def check_size_pair(name: str, value: Any, *, minimum: int = 1) -> tuple[int, int]:
    """``value`` as ``(H, W)``: a sequence of two integers, each at least ``minimum``.

    Raises:
        TypeError: not a sequence of two integers (a string, a single number, three numbers).
        ValueError: a size below ``minimum``.

    Example::

        >>> check_size_pair("image_size", [32, 24.0], minimum=8)
        (32, 24)
        >>> check_size_pair("image_size", (4, 16), minimum=8)
        Traceback (most recent call last):
        ...
        ValueError: `image_size` must be (H, W), two integers ≥ 8, got (4, 16)
    """
    wanted = f"(H, W), two integers ≥ {minimum}"
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"`{name}` must be {wanted}, got {value!r} ({type(value).__name__})")
    try:
        height, width = (check_int(name, size) for size in value)
    except TypeError:
        raise TypeError(f"`{name}` must be {wanted}, got {value!r}") from None
    if min(height, width) < minimum:
        raise ValueError(f"`{name}` must be {wanted}, got {value!r}")
    return height, width


def check_optional_size_pair(name: str, value: Any, *, minimum: int = 1) -> tuple[int, int] | None:
    """Like :func:`check_size_pair`, with ``None`` kept as ``None``.

    Example::

        >>> check_optional_size_pair("image_size", None) is None
        True
    """
    return None if value is None else check_size_pair(name, value, minimum=minimum)


def check_extensions(name: str, value: Any) -> tuple[str, ...]:
    """``value`` as a non-empty list of file name endings (``[".png", ".jpg"]``).

    A single string is refused rather than read letter by letter.

    Raises:
        TypeError: a string, or not a sequence of strings.
        ValueError: an empty list.

    Example::

        >>> check_extensions("extensions", [".png", ".JPG"])
        ('.png', '.JPG')
    """
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            f"`{name}` must be a list of file name endings such as ['.png', '.jpg'], got {value!r}"
            f" ({type(value).__name__})"
        )
    if not value or not all(value):
        raise ValueError(f"`{name}` must be a non-empty list of non-empty file name endings, got {value!r}")
    return tuple(value)


def check_directory(name: str, value: Any, what: str) -> str:
    """``value`` as the path of an existing folder; ``what`` says which (``"tracking dataset"``).

    Raises:
        TypeError: not a path.
        FileNotFoundError: no folder there, naming the argument and the path.

    Example::

        >>> check_directory("root", "/no/such", "image folder")
        Traceback (most recent call last):
        ...
        FileNotFoundError: image folder `root` '/no/such' does not exist or is not a directory
    """
    path = check_path(name, value)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} `{name}` {path!r} does not exist or is not a directory")
    return path


def check_split(val_fraction: Any, seed: Any) -> tuple[float, int]:
    """``(val_fraction, seed)`` of a held-out validation split: a fraction in [0, 1) and a seed ≥ 0.

    Example::

        >>> check_split(0.1, 3.0)
        (0.1, 3)
    """
    return check_fraction("val_fraction", val_fraction, open_maximum=True), check_int("seed", seed, minimum=0)
