"""Synthetic datasets of seeded draws: item ``i`` comes from ``(seed, first + i)`` alone, validation from a later range.

An item is the same whoever reads it, in whatever order and worker, so a synthetic dataset of any
size costs no memory and a resumed run reads what the uninterrupted one read; training and
validation are non-overlapping ranges of draws (:func:`disjoint_ranges`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from torch.utils.data import Dataset

from lightning_memopt.arguments import check_int

D = TypeVar("D", bound=Dataset)


class SeededDataset(Dataset):
    """Base of the synthetic datasets: ``length`` items, item ``i`` drawn when read by :meth:`draw` from a NumPy
    generator seeded with ``(seed, first + i)``.

    Args:
        length: number of items, at least 0.
        seed: seed of the whole dataset, at least 0.
        first: number of the first item, at least 0, so that datasets of non-overlapping ranges (train
            and validation) hold different draws.
        unit: what the items are called in messages (``"samples"``, ``"clips"``).

    Raises:
        ValueError: a number out of range.
        TypeError: a number that is no integer.

    Example::

        >>> class Numbers(SeededDataset):
        ...     def draw(self, rng, number):
        ...         return number
        >>> list(Numbers(3, seed=0, first=10)), len(Numbers(3, seed=0))
        ([10, 11, 12], 3)
    """

    def __init__(self, length: int, seed: int, first: int = 0, unit: str = "samples") -> None:
        self.length = check_int("length", length, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)
        self.first = check_int("first", first, minimum=0)
        self.unit = unit

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= operator.index(index) < self.length:
            raise IndexError(f"index {index!r} out of range for a dataset of {self.length} {self.unit}")
        number = self.first + operator.index(index)
        return self.draw(np.random.default_rng([self.seed, number]), number)

    def draw(self, rng: np.random.Generator, number: int) -> Any:
        """Item number ``number`` (``first + index``), every random choice taken from ``rng``."""
        raise NotImplementedError(f"{type(self).__name__} must implement `draw()`")


def disjoint_ranges(make: Callable[[int, int], D], train_count: int, val_count: int) -> tuple[D, D | None]:
    """``(train, val)``: ``make(count, first)`` of the draws ``0 … train_count − 1`` and of the ``val_count`` after
    them; ``val`` is None when ``val_count`` is 0.

    Example::

        >>> draws = lambda count, first: range(first, first + count)
        >>> disjoint_ranges(draws, 3, 2), disjoint_ranges(draws, 3, 0)
        ((range(0, 3), range(3, 5)), (range(0, 3), None))
    """
    return make(train_count, 0), make(val_count, train_count) if val_count else None
