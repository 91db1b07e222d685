"""The search space of :func:`~lightning_memopt.plan`, and the checks of the arguments that choose it.

The search runs over groups of (precision, attention kernel, micro-batch size); in each, over the
checkpointing frontier (per-block choices); and each step so found over the layouts (FSDP shard
degree, CPU offload).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_memopt.arguments import check_bool, check_fraction
from lightning_memopt.planner.sharding import Sharding


@dataclass
class Group:
    """The steps sharing a precision, an attention kernel and a micro-batch size: one anchor profile estimates them."""

    precision: str
    attn_impl: str | None
    micro_batch_size: int | None
    lower_bound: float = 0.0  # no step of the group is faster (seconds)


DEFAULT_SAFETY_MARGIN = 0.13  # plan(), MemoryBudget, memopt-plan: what gpu_truth.py's calibration row checks


def check_safety_margin(safety_margin: Any) -> float:
    """``safety_margin`` as a float in [0, 1): the fraction of the device's memory a plan keeps free.

    Raises:
        TypeError: not a number (``"abc"``).
        ValueError: outside [0, 1).

    Example::

        >>> check_safety_margin(0.1)
        0.1
    """
    return check_fraction("safety_margin", safety_margin, open_maximum=True)


def check_sequence(name: str, values: Any, empty: bool = False) -> list[Any]:
    """``values`` as a list: a list or tuple, not empty unless ``empty``.

    Raises:
        ValueError: anything else (a string included), naming ``name``.

    Example::

        >>> check_sequence("shards", (1, 2))
        [1, 2]
    """
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not (values or empty):
        kind = "a sequence" if empty else "a non-empty sequence"
        raise ValueError(f"`{name}` must be {kind} (a list or tuple), got {values!r} ({type(values).__name__})")
    return list(values)


def check_choice_in(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value``, one of ``choices`` (a bool never is).

    Raises:
        ValueError: naming the ``name`` entry and the choices.

    Example::

        >>> check_choice_in("precisions", "bf16-mixed", ("32-true", "bf16-mixed"))
        'bf16-mixed'
    """
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}` entry {value!r} is not one of {list(choices)!r}")
    return value


def layouts_for(devices: int, shards: Sequence[int] | None, cpu_offload: Sequence[bool]) -> list[Sharding]:
    """Every (shard degree, offload) considered, unsharded first; validates ``shards`` and ``cpu_offload``.

    ``shards`` default: 1, every power of two below ``devices``, and ``devices``.

    Raises:
        ValueError: a shard degree outside 1 … ``devices``, or ``cpu_offload`` that is no non-empty
            sequence of bools.

    Example::

        >>> [layout.describe() or "unsharded" for layout in layouts_for(4, None, (False, True))]
        ['unsharded', 'FSDP ×2', 'FSDP ×4', 'CPU offload', 'FSDP ×2, CPU offload', 'FSDP ×4, CPU offload']
    """
    if shards is None:
        shards = sorted({1, devices, *(2**power for power in range(devices.bit_length()) if 2**power < devices)})
    for degree in check_sequence("shards", shards):
        if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= devices:
            raise ValueError(f"`shards` entry {degree!r} must be an int from 1 to `devices`={devices}")
    if isinstance(cpu_offload, str | bytes) or not isinstance(cpu_offload, Sequence) or not cpu_offload:
        raise ValueError(
            f"`cpu_offload`={cpu_offload!r} must be a non-empty sequence of True / False: (False, True) considers "
            "both, (False,) never offloads"
        )
    flags = [check_bool("cpu_offload", flag) for flag in cpu_offload]
    found = [Sharding(degree, flag) for degree in shards for flag in flags]
    return sorted(set(found), key=lambda layout: (layout.active, layout.cpu_offload, layout.shards))


def micro_batch_sizes(size: int) -> list[int | None]:
    """Whole batches (``None``), then micro-batches halved (rounded up) down to one sample.

    Example::

        >>> micro_batch_sizes(6)
        [None, 3, 2, 1]
    """
    sizes: list[int | None] = [None]
    current = size
    while current > 1:
        current = math.ceil(current / 2)
        sizes.append(current)
    return sizes
