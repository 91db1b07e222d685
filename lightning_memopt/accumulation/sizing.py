"""The micro-batch size: over a run, the smallest a model takes, and how a batch is cut into pieces.

:class:`MicroBatchSizer` shrinks the size after out-of-memory errors and allocator thrashing and grows it back
after a stretch of steps without either; the smallest size is what inspection sees (batch norm in training) and
what errors taught; a batch is cut into pieces none below that smallest size, and smaller after a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from lightning_memopt.private_api import is_batch_norm

Shrink = Callable[[int], int]  # the next micro-batch size after an out-of-memory error


def halve(size: int) -> int:
    """The next micro-batch size after an out-of-memory error: half, rounded up.

    Example::

        >>> [halve(n) for n in (64, 3, 2)]
        [32, 2, 1]
    """
    return (size + 1) // 2


class MicroBatchSizer:
    """Decide each batch's micro-batch size from what happened in earlier steps.

    ``size`` is ``None`` while batches run whole. After an out-of-memory recovery it is the size
    that worked, and ``oom_recoveries`` counts the batches recovered. With ``grow_after``, after
    that many optimizer steps without an error it doubles (back to whole batches once it reaches
    the batch). A growth that runs out of memory within the interval doubles the interval, so a
    size that does not fit is not retried every N steps. Allocator thrashing (retries in
    ``thrash_steps`` consecutive batches) shrinks it before it fails. It never goes below
    ``min_size``, the smallest micro-batch the model takes (a batch of fewer samples runs whole).

    Args:
        size: the first micro-batch size (``None``: whole batches), e.g. from the planner. A run
            resumed from a checkpoint keeps the checkpoint's size unless this one is smaller.
        shrink: ``size -> smaller size`` (default: halve).
        grow_after: optimizer steps without an error before doubling; ``None`` never grows.
        thrash_steps: consecutive steps with allocator retries that shrink pre-emptively; ``None``: off.
        min_size: the smallest size it gives (2 for batch norm in training); settable later.

    Raises:
        ValueError: for a size, ``grow_after``, ``thrash_steps`` or ``min_size`` below 1.

    Example::

        >>> sizer = MicroBatchSizer(grow_after=10)
        >>> sizer.size_for(step=0, batch_size=64)
        64
        >>> sizer.recovered(step=3, size=16)
        >>> sizer.size_for(step=12, batch_size=64), sizer.size_for(step=13, batch_size=64)
        (16, 32)
    """

    def __init__(
        self,
        size: int | None = None,
        shrink: Shrink = halve,
        grow_after: int | None = None,
        thrash_steps: int | None = None,
        min_size: int = 1,
    ) -> None:
        for name, value in (("micro_batch_size", size), ("grow_after", grow_after), ("thrash_steps", thrash_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}`={value!r} must be an int ≥ 1 or None")
        check_min_size(min_size)
        self.size = size
        self.min_size = min_size
        self.shrink = shrink
        self.grow_after = grow_after
        self.thrash_steps = thrash_steps
        self.grow_interval = grow_after
        self.oom_recoveries = 0
        self.preemptive_shrinks = 0
        self.last_change_step = 0
        self.grew_at: int | None = None
        self.thrashing_steps = 0  # consecutive steps with allocator retries
        self.largest_batch = 0  # growth stops at the loader's batch, not at a short last batch

    def size_for(self, step: int, batch_size: int) -> int:
        """The micro-batch size for a batch of ``batch_size`` at optimizer step ``step`` (grows back when due)."""
        self.largest_batch = max(self.largest_batch, batch_size)
        if (
            self.size is not None
            and self.grow_interval is not None
            and step - self.last_change_step >= self.grow_interval
        ):
            self.size = None if 2 * self.size >= self.largest_batch else 2 * self.size
            self.last_change_step = self.grew_at = step
        return batch_size if self.size is None else min(max(self.size, self.min_size), batch_size)

    def recovered(self, step: int, size: int) -> None:
        """A batch ran out of memory (on some rank) and completed in micro-batches of ``size``."""
        if self.grow_interval is not None and self.grew_at is not None and step - self.grew_at < self.grow_interval:
            self.grow_interval *= 2  # the last growth did not fit: wait longer before the next
        self.size = max(size, self.min_size)
        self.oom_recoveries += 1
        self.last_change_step = step
        self.thrashing_steps = 0

    def allocator_retried(self, retried: bool, step: int, batch_size: int) -> bool:
        """Count a step with (or without) allocator retries; shrink when thrashing. Whether it shrank."""
        self.thrashing_steps = self.thrashing_steps + 1 if retried else 0
        if self.thrash_steps is None or self.thrashing_steps < self.thrash_steps:
            return False
        current = batch_size if self.size is None else min(max(self.size, self.min_size), batch_size)
        if current <= self.min_size:
            return False
        self.size = max(self.shrink(current), self.min_size)
        self.preemptive_shrinks += 1
        self.last_change_step = step
        self.thrashing_steps = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "grow_after": self.grow_after,
            "grow_interval": self.grow_interval,
            "oom_recoveries": self.oom_recoveries,
            "preemptive_shrinks": self.preemptive_shrinks,
            "last_change_step": self.last_change_step,
            "grew_at": self.grew_at,
            "largest_batch": self.largest_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("size", self.size)
        if self.size is None or (saved is not None and saved < self.size):  # a smaller size given now wins
            self.size = saved
        if state.get("grow_after") == self.grow_after:  # a run resumed with another `grow_after` starts afresh
            self.grow_interval = state.get("grow_interval", self.grow_interval)
        self.oom_recoveries = state.get("oom_recoveries", 0)
        self.preemptive_shrinks = state.get("preemptive_shrinks", 0)
        self.last_change_step = state.get("last_change_step", 0)
        self.grew_at = state.get("grew_at")
        self.largest_batch = state.get("largest_batch", 0)


MinSize = tuple[int | None, str | None]  # a smallest size (None: none known) and why


def check_min_size(min_size: int) -> None:
    """Raise ``ValueError`` unless ``min_size`` is an int ≥ 1."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"`min_size`={min_size!r} must be an int ≥ 1 (1: any size; 2: batch norm in training)")


def batch_norms(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of ``module`` (what :func:`min_micro_batch_size` looks at)."""
    return [m for m in module.modules() if is_batch_norm(m)]


def min_micro_batch_size(module: nn.Module, norms: list[nn.Module] | None = None) -> tuple[int, str | None]:
    """The smallest micro-batch ``module`` takes as it is now, and why (``None`` when any size does).

    A batch-norm layer that normalises by the batch's statistics (in training, or without running
    statistics) needs at least 2 samples for an ``[N, C]`` input: one sample has no variance.
    ``norms``: the module's :func:`batch_norms`, when already known (their modes are read now).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> min_micro_batch_size(model)
        (2, 'its BatchNorm1d layers need at least 2 samples in training')
        >>> min_micro_batch_size(model.eval())
        (1, None)
    """
    layers = sorted(
        {
            type(m).__name__
            for m in (batch_norms(module) if norms is None else norms)
            if m.training or (m.running_mean is None and m.running_var is None)
        }
    )
    if not layers:
        return 1, None
    return 2, f"its {', '.join(layers)} layers need at least 2 samples in training"


def largest_min_size(seen: tuple[int, str | None], *learned: MinSize) -> tuple[int, str | None]:
    """The largest of the minimum inspection ``seen`` and those errors taught (``None``: none); the first of equals.

    Example::

        >>> largest_min_size((2, "batch norm"), (None, None), (3, "a piece of 2 failed"), (3, "again"))
        (3, 'a piece of 2 failed')
    """
    size, reason = seen
    for least, why in learned:
        if least is not None and least > size:
            size, reason = least, why
    return size, reason


class _Runner(Protocol):  # what :func:`update_min_size` reads and sets of a MicroBatchRunner
    module: nn.Module
    min_size: int
    min_size_reason: str | None
    learned_min_size: int | None
    learned_min_size_reason: str | None


def update_min_size(runner: _Runner, norms: list[nn.Module] | None, *learned: MinSize) -> tuple[int, str | None]:
    """Set ``runner``'s minimum to what its module takes as it is now, or more when an error taught more.

    Args:
        runner: a :class:`~lightning_memopt.accumulation.MicroBatchRunner`; what it learned counts.
        norms: its module's :func:`batch_norms`, when already listed (``None``: the module is walked).
        learned: other minimums errors taught, ``(size or None, why)``.

    Example::

        >>> from lightning_memopt.accumulation import MicroBatchRunner
        >>> runner = MicroBatchRunner(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
        >>> update_min_size(runner, None, (3, "a piece of 2 failed")), runner.min_size
        ((3, 'a piece of 2 failed'), 3)
    """
    seen = min_micro_batch_size(runner.module, norms)
    size, reason = largest_min_size(seen, (runner.learned_min_size, runner.learned_min_size_reason), *learned)
    runner.min_size, runner.min_size_reason = size, reason
    return size, reason


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

        >>> redo_size(18, halve, 2), redo_size(9, halve, 1)
        (10, 5)
    """
    smaller = shrink(failed)
    if isinstance(smaller, bool) or not isinstance(smaller, int) or not 1 <= smaller < failed:
        raise ValueError(f"`shrink`({failed}) returned {smaller!r}; it must return an int in [1, {failed - 1}]")
    rounded = -(-smaller // least) * least
    return rounded if rounded < failed else max(smaller // least * least, least)
