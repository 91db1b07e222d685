"""The CUDA allocator's peak of allocated bytes, for callbacks that reset it at different times.

``torch.cuda.reset_peak_memory_stats`` resets one counter per device for the whole process: a
monitor that resets it after each sample would leave a fit-long reader with the peak since that
sample only. Reset through :func:`reset_peak` instead, which first folds the peak so far into a
per-device high-water mark, and read the fit's peak with :func:`peak_since_mark`.

Example::

    >>> import torch
    >>> if torch.cuda.is_available():
    ...     device = torch.device("cuda")
    ...     mark_peak(device)
    ...     reset_peak(device)  # a monitor's window ends: the fit's peak is kept
    ...     assert peak_since_mark(device) >= 0
"""

from __future__ import annotations

import torch

# device index -> the highest peak of allocated bytes folded in since the last mark
_high_water: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_peak(device: torch.device) -> None:
    """Reset the allocator's peak of ``device``, keeping the peak so far for :func:`peak_since_mark`."""
    index = _index(device)
    _high_water[index] = max(_high_water.get(index, 0), torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


def mark_peak(device: torch.device) -> None:
    """Start a new window on ``device``: reset the allocator's peak and forget the high-water mark."""
    _high_water.pop(_index(device), None)
    torch.cuda.reset_peak_memory_stats(device)


def peak_since_mark(device: torch.device) -> int:
    """The highest allocated bytes on ``device`` since :func:`mark_peak`, across every :func:`reset_peak`."""
    return max(_high_water.get(_index(device), 0), torch.cuda.max_memory_allocated(device))
