"""When offloaded activations come back: the prefetch order of the groups one step offloads.

One ``offload_to_host()`` context (one offloaded block call) packs one *group*. The forward pass
packs the groups in order; the backward pass needs them back in roughly the reverse order. So when
the backward first unpacks a tensor of a group, that group's copies start (unless already under
way) and so do those of the group packed just before it, the one the backward needs next: its
copies overlap this block's backward. The rule is pure Python, kept apart from the copies so that
it is tested without a device.

Example::

    >>> class Group:  # anything weakly referable stands for a group
    ...     def __init__(self, name):
    ...         self.name = name
    >>> schedule = PrefetchSchedule()
    >>> groups = [Group(name) for name in "abc"]
    >>> for group in groups:
    ...     schedule.add(group)
    >>> [g.name for g in schedule.first_unpack(groups[2])]  # the last block's backward runs first
    ['c', 'b']
    >>> [g.name for g in schedule.first_unpack(groups[1])]  # b was prefetched: only a is due
    ['a']
    >>> schedule.first_unpack(groups[1])  # a group's later unpacks start nothing
    []
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

_PRUNE_FROM = 64  # groups remembered before released ones are first forgotten


class PrefetchSchedule:
    """Which offloaded groups to bring back when the backward pass first unpacks a group.

    Groups are held weakly: a group whose saved tensors autograd has released (its backward has
    run, or its graph was dropped) disappears from the order, and a prefetch passes over it to the
    group packed before it. A group is started at most once. Released groups are forgotten as new
    ones arrive (a step kept alive by a graph that is never run does not grow without bound).
    """

    def __init__(self) -> None:
        self._order: list[tuple[int, weakref.ref[Any]]] = []  # (number, group) in the order the forward packed them
        self._number: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._added = 0
        self._kept = _PRUNE_FROM  # prune released groups from the order once it is twice this long
        self._started: weakref.WeakSet[Any] = weakref.WeakSet()  # fetched, or being fetched
        self._unpacked: weakref.WeakSet[Any] = weakref.WeakSet()  # the backward has unpacked from them
        self._lock = threading.Lock()  # the forward's thread adds, autograd's device thread unpacks

    def add(self, group: Any) -> None:
        """Append ``group``, packed after every group added so far."""
        with self._lock:
            self._number[group] = self._added
            self._order.append((self._added, weakref.ref(group)))
            self._added += 1
            if len(self._order) >= 2 * self._kept:
                self._order = [(number, reference) for number, reference in self._order if reference() is not None]
                self._kept = max(len(self._order), _PRUNE_FROM)

    def first_unpack(self, group: Any) -> list[Any]:
        """The groups whose copies to start now that the backward unpacks from ``group``, in that order.

        On the first unpack of ``group``: itself, unless already started, then the nearest live group
        packed before it, unless already started. On any later unpack: none.

        Raises:
            KeyError: ``group`` was never added.
        """
        with self._lock:
            number = self._number[group]
            if group in self._unpacked:
                return []
            self._unpacked.add(group)
            due = [group]
            for _, reference in reversed(self._order[: bisect.bisect_left(self._order, number, key=lambda x: x[0])]):
                previous = reference()
                if previous is not None:
                    due.append(previous)
                    break
            due = [g for g in due if g not in self._started]
            self._started.update(due)
            return due

    def live_groups(self) -> list[Any]:
        """The groups still holding offloaded tensors, in packing order."""
        with self._lock:
            return [group for group in (reference() for _, reference in self._order) if group is not None]

    def __len__(self) -> int:
        """The groups remembered: the live ones, and released ones not yet forgotten."""
        return len(self._order)
