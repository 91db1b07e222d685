"""lightning_memopt: make memory-hungry vision training fit on the GPUs people have.

Example::

    >>> import lightning_memopt
    >>> lightning_memopt.create_model("iresnet_tiny").embedding_size
    32
"""

from typing import Any

from lightning_memopt.callbacks import (
    ActivationCheckpointing,
    AdaptiveAccumulation,
    MemoryBudget,
    MemoryMonitor,
    PrecisionSwitch,
    TrainingSummary,
)
from lightning_memopt.models import create_model, list_models
from lightning_memopt.planner import plan
from lightning_memopt.strategies import MemoptDDPStrategy, MemoptFSDPStrategy  # registers the strategy names

__all__ = [
    "ActivationCheckpointing",
    "AdaptiveAccumulation",
    "MemoptDDPStrategy",
    "MemoptFSDPStrategy",
    "MemoryBudget",
    "MemoryMonitor",
    "PrecisionSwitch",
    "TrainingSummary",
    "create_model",
    "list_models",
    "plan",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from lightning_memopt.__about__ import __version__

        return __version__
    raise AttributeError(f"module 'lightning_memopt' has no attribute {name!r}")
