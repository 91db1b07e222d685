"""lightning_memopt: make memory-hungry vision training fit on the GPUs people have.

Importing the package is cheap: ``import lightning_memopt`` imports neither torch nor Lightning, so the
command-line apps answer ``--help``, ``--cfg job`` and shell completion at once. Each public name
(:data:`__all__`) is imported on its first use: ``lightning_memopt.MemoryMonitor``,
``from lightning_memopt import create_model``, or a class path such as ``lightning_memopt.MemoryMonitor``
resolved by jsonargparse / ``LightningCLI`` or Hydra's ``_target_``.

Strategy names (``ddp_memopt``, ``ddp_powersgd``, ``ddp_fp16_compress``, ``ddp_bf16_compress``,
``fsdp_memopt``) are registered in Lightning's ``StrategyRegistry`` once both packages are imported, in
either order (:mod:`lightning_memopt.registration`): after ``import lightning_memopt``,
``Trainer(strategy="ddp_powersgd")`` works.

Example::

    >>> import lightning_memopt
    >>> lightning_memopt.create_model("iresnet_tiny").embedding_size
    32
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "ddp_memopt" in StrategyRegistry and "fsdp_memopt" in StrategyRegistry
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_memopt.registration import register_when_lightning_loads

register_when_lightning_loads()  # Lightning learns the strategy names when it loads (now, if it has)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports each name on first use
    from lightning_memopt.callbacks import (
        ActivationCheckpointing,
        AdaptiveAccumulation,
        MemoryBudget,
        MemoryMonitor,
        PrecisionSwitch,
        StepAccumulationScheduler,
        TrainingSummary,
    )
    from lightning_memopt.models import create_model, list_models
    from lightning_memopt.planner import plan
    from lightning_memopt.strategies import MemoptDDPStrategy, MemoptFSDPStrategy

# public name -> the module it is imported from on first use
_LAZY = {
    "ActivationCheckpointing": "lightning_memopt.callbacks",
    "AdaptiveAccumulation": "lightning_memopt.callbacks",
    "MemoryBudget": "lightning_memopt.callbacks",
    "MemoryMonitor": "lightning_memopt.callbacks",
    "PrecisionSwitch": "lightning_memopt.callbacks",
    "StepAccumulationScheduler": "lightning_memopt.callbacks",
    "TrainingSummary": "lightning_memopt.callbacks",
    "MemoptDDPStrategy": "lightning_memopt.strategies",
    "MemoptFSDPStrategy": "lightning_memopt.strategies",
    "create_model": "lightning_memopt.models",
    "list_models": "lightning_memopt.models",
    "plan": "lightning_memopt.planner",
}

__all__ = [
    "ActivationCheckpointing",
    "AdaptiveAccumulation",
    "MemoptDDPStrategy",
    "MemoptFSDPStrategy",
    "MemoryBudget",
    "MemoryMonitor",
    "PrecisionSwitch",
    "StepAccumulationScheduler",
    "TrainingSummary",
    "create_model",
    "list_models",
    "plan",
]


def __getattr__(name: str) -> Any:
    """Import a public name on its first use; ``AttributeError`` for others.

    Raises:
        AttributeError: ``name`` is not a public name of the package (a submodule not yet imported is then
            imported by Python's ``from lightning_memopt import …``).

    Example::

        >>> import lightning_memopt
        >>> lightning_memopt.list_models is lightning_memopt.models.list_models
        True
        >>> lightning_memopt.no_such_name
        Traceback (most recent call last):
        ...
        AttributeError: module 'lightning_memopt' has no attribute 'no_such_name'
    """
    if name == "__version__":
        from lightning_memopt.__about__ import __version__

        return __version__
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_memopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later uses do not come back here
    return value


def __dir__() -> list[str]:
    """The module's names, the public ones not yet imported included."""
    return sorted({*globals(), *__all__, "__version__"})
