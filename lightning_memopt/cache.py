"""The project's cache folder: what it measured on this machine and keeps between runs.

``$LIGHTNING_MEMOPT_CACHE`` (default ``~/.cache/lightning_memopt``) holds ``cpu_rates.json`` (this CPU's rates,
:mod:`~lightning_memopt.planner.calibration`) and ``measurements.json`` (the candidates timed on a device,
:mod:`~lightning_memopt.planner.remembered`). Deleting a file makes the project measure again.

Example::

    >>> cache_folder().name in ("lightning_memopt", os.environ.get(CACHE_VARIABLE, "").rsplit("/", 1)[-1])
    True
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "LIGHTNING_MEMOPT_CACHE"


def cache_folder() -> Path:
    """``$LIGHTNING_MEMOPT_CACHE``, else ``~/.cache/lightning_memopt``."""
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "lightning_memopt")
