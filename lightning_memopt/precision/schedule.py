"""A precision schedule: which precision holds from which optimizer step (or epoch) on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict

from lightning_memopt.precision.resolve import normalise_precision
from lightning_memopt.vocabulary import PrecisionSetting

INTERVALS = ("step", "epoch")
ScheduleInterval = Literal["step", "epoch"]  # == INTERVALS
_ENTRY_KEYS = ("start", "end", "precision")


class ScheduleEntryMapping(TypedDict):
    """A schedule entry as a mapping: ``precision`` from ``start`` up to (not including) ``end``."""

    start: int
    end: NotRequired[int | None]
    precision: PrecisionSetting


# ``{start: precision}``, or a list of ``[start, precision]`` pairs and ``{start, end, precision}`` mappings
PrecisionScheduleSpec = Mapping[int, PrecisionSetting] | Sequence[tuple[int, PrecisionSetting] | ScheduleEntryMapping]


@dataclass(frozen=True)
class ScheduleEntry:
    """``precision`` from ``start`` up to (not including) ``end``; ``end=None`` lasts until the next entry."""

    start: int
    end: int | None
    precision: str  # a Lightning precision string, or "auto"


def check_interval(interval: str) -> str:
    """``interval`` if it is ``"step"`` or ``"epoch"``.

    Raises:
        ValueError: naming ``schedule_interval``, the value and the choices.
    """
    if not isinstance(interval, str) or interval not in INTERVALS:
        raise ValueError(f"Unknown `schedule_interval`={interval!r}; valid choices: {', '.join(INTERVALS)}")
    return interval


class PrecisionSchedule:
    """Precisions by optimizer step or epoch, given in the order they happen.

    Args:
        entries: ``{start: precision}``; or a list of ``[start, precision]`` pairs and
            ``{"start", "end", "precision"}`` mappings. An entry lasts until its ``end`` or, without
            one, until the next entry starts. Positions no entry covers (before the first, or in a
            gap after an ``end``) keep the run's base precision. ``"auto"`` is a valid precision.
        interval: ``"step"`` (optimizer steps, ``trainer.global_step``) or ``"epoch"``.

    Raises:
        ValueError: an unknown interval or precision, a negative start, an ``end`` not after its
            start, entries out of order, or two entries that overlap.

    Example::

        >>> schedule = PrecisionSchedule({0: "32-true", 500: "bf16-mixed"})
        >>> schedule.at(499), schedule.at(500)
        ('32-true', 'bf16-mixed')
        >>> PrecisionSchedule([{"start": 100, "end": 200, "precision": "32-true"}]).at(200) is None
        True
    """

    def __init__(self, entries: PrecisionScheduleSpec, interval: ScheduleInterval = "step") -> None:
        self.interval = check_interval(interval)
        if not isinstance(entries, Mapping) and (isinstance(entries, str) or not isinstance(entries, Sequence)):
            raise ValueError(
                f"`schedule` must be {{start: precision}} or a list of [start, precision] pairs and "
                f"{{start, end, precision}} mappings, got {entries!r} ({type(entries).__name__})"
            )
        items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
        if not items:
            raise ValueError("`schedule` is empty; give {start: precision} entries, or None for no schedule")
        self.entries = tuple(_entry(item) for item in items)
        for before, after in zip(self.entries, self.entries[1:], strict=False):
            if after.start < before.start:
                raise ValueError(
                    f"`schedule` is not sorted: the entry starting at {interval} {after.start} comes after the one at "
                    f"{before.start}; list entries in the order they start"
                )
            if after.start == before.start or (before.end is not None and before.end > after.start):
                raise ValueError(
                    f"`schedule` entries overlap: {_describe(before, interval)} and {_describe(after, interval)}"
                )

    def at(self, position: int) -> str | None:
        """The precision scheduled at ``position`` (a step or epoch), or ``None`` where no entry covers it."""
        found = None
        for entry in self.entries:
            if entry.start > position:
                break
            found = entry if entry.end is None or position < entry.end else None
        return found.precision if found is not None else None

    def describe(self) -> str:
        """``"step 0: 32-true, step 500: bf16-mixed"``."""
        return ", ".join(_describe(entry, self.interval) for entry in self.entries)


def _entry(item: Any) -> ScheduleEntry:
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - set(_ENTRY_KEYS))
        if unknown or "start" not in item or "precision" not in item:
            raise ValueError(
                f"`schedule` entry {dict(item)!r} needs the keys start and precision (and optionally end); "
                f"unknown keys: {unknown or 'none'}"
            )
        start, end, precision = item["start"], item.get("end"), item["precision"]
    elif isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
        (start, precision), end = item, None
    else:
        raise ValueError(
            f"`schedule` entry {item!r} must be a [start, precision] pair or a mapping of start/end/precision"
        )
    start = _position(start, "start")
    end = None if end is None else _position(end, "end")
    if end is not None and end <= start:
        raise ValueError(f"`schedule` entry starting at {start} has `end`={end}; it must be after the start")
    precision = "auto" if precision == "auto" else normalise_precision(precision, "schedule precision")
    return ScheduleEntry(start, end, precision)


def _position(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
        raise ValueError(f"`schedule` {key} {value!r} must be a step or epoch number ≥ 0")
    return int(value)


def _describe(entry: ScheduleEntry, interval: str) -> str:
    span = f"{interval} {entry.start}" + (f"–{entry.end}" if entry.end is not None else "")
    return f"{span}: {entry.precision}"
