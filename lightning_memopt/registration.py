"""Lightning learns the strategy names (``ddp_memopt``, ``ddp_powersgd``, …) once both are imported, in any order.

``import lightning_memopt`` stays cheap (no torch, no Lightning: the apps' ``--help`` answers at once), so the
names cannot be registered then. :func:`register_when_lightning_loads` registers them at once where Lightning is
loaded already, and otherwise the moment ``lightning.pytorch`` finishes loading: a finder on ``sys.meta_path``
waits for that one module, then steps aside. ``Trainer(strategy="ddp_powersgd")`` after ``import
lightning_memopt`` works either way.

Example::

    >>> import lightning_memopt  # registers on import: nothing to call
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "ddp_powersgd" in StrategyRegistry
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_LIGHTNING = "lightning.pytorch"
_STRATEGIES = "lightning_memopt.strategies"

# name → (description, the strategy class in lightning_memopt.strategies, its init parameters)
STRATEGY_NAMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ddp_memopt": (
        "DDP with gradient buckets as views, static graph under activation checkpointing",
        "MemoptDDPStrategy",
        {"comm_hook": "none"},
    ),
    "ddp_powersgd": (
        "ddp_memopt + PowerSGD gradient compression (rank 1, error feedback)",
        "MemoptDDPStrategy",
        {"comm_hook": "powersgd"},
    ),
    "ddp_fp16_compress": ("ddp_memopt + gradients all-reduced in fp16", "MemoptDDPStrategy", {"comm_hook": "fp16"}),
    "ddp_bf16_compress": ("ddp_memopt + gradients all-reduced in bf16", "MemoptDDPStrategy", {"comm_hook": "bf16"}),
    "fsdp_memopt": (
        "FSDP2: a unit per model block, bf16 gathers under bf16-mixed, optional CPU offload",
        "MemoptFSDPStrategy",
        {},
    ),
}


@dataclass(frozen=True)
class LazyStrategy:
    """What the registry holds for a name: it builds the strategy when Lightning asks for it, importing
    :mod:`lightning_memopt.strategies` only then (registering imports none of the package, so no import cycle
    can stop it, whichever module of the package was being imported when Lightning loaded)."""

    class_name: str

    def resolve(self) -> type:
        """The strategy class."""
        return getattr(importlib.import_module(_STRATEGIES), self.class_name)

    def __call__(self, **init_params: Any) -> Any:
        return self.resolve()(**init_params)


def register_strategy_names() -> None:
    """Put :data:`STRATEGY_NAMES` in Lightning's ``StrategyRegistry`` (imports Lightning, not the strategies)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (description, class_name, init_params) in STRATEGY_NAMES.items():
        StrategyRegistry.register(name, LazyStrategy(class_name), description=description, override=True, **init_params)


def registered_class(entry: Any) -> Any:
    """The class behind a ``StrategyRegistry`` entry's ``"strategy"``: resolved where it is a :class:`LazyStrategy`.

    Example::

        >>> registered_class(LazyStrategy("MemoptFSDPStrategy")).__name__
        'MemoptFSDPStrategy'
    """
    return entry.resolve() if isinstance(entry, LazyStrategy) else entry


class _AfterLightningLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``lightning.pytorch`` is imported, it has the real loader register the names
    after running the module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)  # once: the other finders locate the module
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _then_register(spec.loader.exec_module)  # this module's loader only
                return spec
        return None


def _then_register(exec_module: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def run_then_register(module: ModuleType) -> None:
        exec_module(module)
        register_strategy_names()

    return run_then_register


def register_when_lightning_loads() -> None:
    """Register the strategy names now if Lightning is loaded, else as soon as it is (once)."""
    if _LIGHTNING in sys.modules:
        register_strategy_names()
    elif not any(isinstance(finder, _AfterLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningLoads())
