"""MicroBatchSizer: the micro-batch size over a run — shrunk by out-of-memory errors and allocator
thrashing, grown back after a stretch of steps without either."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_memopt.accumulation.min_size import check_min_size

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
