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
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_LIGHTNING = "lightning.pytorch"
_STRATEGIES = "lightning_memopt.strategies"  # registers the names in Lightning's StrategyRegistry on import


def _register() -> None:
    try:
        importlib.import_module(_STRATEGIES)
    except Exception as error:  # noqa: BLE001 — a failure here must not break the user's `import lightning`
        warnings.warn(
            f"lightning_memopt could not register its strategy names with Lightning ({type(error).__name__}: "
            f"{error}); `import lightning_memopt.strategies` shows the whole error",
            stacklevel=2,
        )


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
        _register()

    return run_then_register


def register_when_lightning_loads() -> None:
    """Register the strategy names now if Lightning is loaded, else as soon as it is (once)."""
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningLoads())
