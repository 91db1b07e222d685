"""How a batch is cut into micro-batches: none below the smallest the model takes, and smaller after a failure."""

from __future__ import annotations

from collections.abc import Callable


def next_piece(remaining: int, size: int, least: int) -> int:
    """How many of ``remaining`` samples the next piece takes: ``size``, unless that leaves fewer than ``least``.

    A remainder too small for a piece of its own is folded into the piece before it.

    Example::

        >>> [next_piece(remaining, 8, 2) for remaining in (17, 9, 2)]  # 17 in pieces of 8 run as 8, 7, 2
        [8, 7, 2]
    """
    size = max(size, least)
    if remaining <= size or remaining - size >= least:
        return min(size, remaining)
    if remaining >= 2 * least:
        return remaining - least  # ≤ size, and the rest is one piece of `least`
    return remaining  # too few for two pieces: one, above `size`


def count_pieces(total: int, size: int, least: int) -> int:
    """How many pieces :func:`next_piece` cuts ``total`` samples into.

    Example::

        >>> count_pieces(17, 8, 2)
        3
    """
    pieces, position = 0, 0
    while position < total:
        position += next_piece(total - position, size, least)
        pieces += 1
    return pieces


def redo_size(failed: int, shrink: Callable[[int], int], least: int) -> int:
    """The size to redo ``failed`` (≥ 2 · ``least``) samples with: ``shrink``'s, at a multiple of ``least``.

    A multiple keeps the pieces' boundaries in step with the minimum: 18 samples of a model that
    takes no fewer than 2, and fits no more, go 10 → 6 → 4 → 2 and never leave a piece of 3.

    Raises:
        ValueError: when ``shrink(failed)`` is not an int in ``[1, failed - 1]``.

    Example::

        >>> from lightning_memopt.accumulation.sizing import halve
        >>> redo_size(18, halve, 2), redo_size(9, halve, 1)
        (10, 5)
    """
    smaller = shrink(failed)
    if isinstance(smaller, bool) or not isinstance(smaller, int) or not 1 <= smaller < failed:
        raise ValueError(f"`shrink`({failed}) returned {smaller!r}; it must return an int in [1, {failed - 1}]")
    rounded = -(-smaller // least) * least
    return rounded if rounded < failed else max(smaller // least * least, least)
