"""AccumulationSchedule: how many batches each optimizer step accumulates, by optimizer step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class AccumulationSchedule:
    """``accumulate_grad_batches`` from a given optimizer step on (Lightning's own scheduler goes by epoch).

    Steps before the first entry accumulate 1 batch.

    Args:
        entries: ``{first optimizer step: batches per step}``, e.g. ``{0: 1, 1000: 4}``.
        name: the argument the entries came from, for the error messages.

    Raises:
        ValueError: for an empty schedule, a step that is not an int ≥ 0, or a count that is not an int ≥ 1.

    Example::

        >>> schedule = AccumulationSchedule({0: 1, 1000: 4, 5000: 8})
        >>> schedule.at(999), schedule.at(1000), schedule.at(10**6)
        (1, 4, 8)
        >>> schedule.describe()
        '{0: 1, 1000: 4, 5000: 8}'
    """

    def __init__(self, entries: Mapping[Any, Any], name: str = "accumulate_schedule") -> None:
        if not isinstance(entries, Mapping) or not entries:
            raise ValueError(f"`{name}`={entries!r} must be a non-empty {{step: batches}} mapping")
        parsed: dict[int, int] = {}
        for step, count in entries.items():
            step_value, count_value = _as_int(step), _as_int(count)
            if step_value is None or step_value < 0:
                raise ValueError(f"`{name}` step {step!r} must be an int ≥ 0")
            if count_value is None or count_value < 1:
                raise ValueError(f"`{name}`[{step!r}]={count!r} must be an int ≥ 1 (batches per step)")
            parsed[step_value] = count_value
        self.entries = dict(sorted(parsed.items()))

    def at(self, step: int) -> int:
        """Batches accumulated by the optimizer step ``step``."""
        count = 1
        for start, value in self.entries.items():
            if start > step:
                break
            count = value
        return count

    def describe(self) -> str:
        """The schedule as ``{step: batches, ...}`` (what checkpoints keep, to compare with a resumed run's)."""
        return "{" + ", ".join(f"{step}: {count}" for step, count in self.entries.items()) + "}"


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():  # Hydra/YAML may give keys as strings
        return int(value)
    return None
