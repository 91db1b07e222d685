"""This process's random number generators as plain data: taken, and set back (a resume, a step redone).

Example::

    >>> import torch
    >>> state = capture_random_state()
    >>> first = torch.rand(1)
    >>> restore_random_state(state)
    >>> torch.equal(torch.rand(1), first)
    True
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture_random_state() -> dict[str, Any]:
    """This process's torch (CPU and its current CUDA device), numpy and Python RNG states, as plain data.

    Plain tensors, lists and numbers: a checkpoint holding them loads with ``torch.load(weights_only=True)``.
    """
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # the current device's only: a rank draws on its own GPU, and the resuming machine may have fewer
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gauss)],
        "python": [version, list(internal), gauss_next],
    }


def restore_random_state(state: dict[str, Any]) -> None:
    """Set the generators to ``state`` from :func:`capture_random_state` (CUDA only where it was captured)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state(state["cuda"][0])
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Run the block, then set every generator back as it was: Python's, NumPy's, torch's on the CPU and on each CUDA
    device in use. What the block draws (a planner's profiles, a trial step) leaves the run's random numbers alone.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> with random_state_kept():
        ...     drawn = torch.rand(3)
        >>> torch.equal(torch.rand(3), drawn)
        True
    """
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
