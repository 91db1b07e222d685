"""fp32 islands: submodules that run with autocast off and fp32 inputs inside a mixed-precision model.

Some numerics need fp32 whatever the rest of the step runs in: a margin head's logits over
85 k classes, a topological loss's pairwise distances, a normal head's final conv. An island gets
an instance ``forward`` that casts its half-precision floating inputs to fp32 and disables
autocast around the class's forward, so it computes and returns fp32. The island sits innermost,
under activation checkpointing's wrapper if there is one, so the two compose in either order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_memopt.models.structure import model_structure
from lightning_memopt.private_api import tree_map
from lightning_memopt.selection import ModuleSpec, describe_model, normalise_specs, select_modules

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_HALF = (torch.float16, torch.bfloat16)


class Fp32Forward:
    """The instance ``forward`` of an fp32 island: inputs to fp32, autocast off, then the real forward."""

    def __init__(self, module: nn.Module, previous: Callable[..., Any] | None) -> None:
        self.module = module
        self.previous = previous  # an instance forward that was there before ours, kept and restored

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_to_fp32, (args, kwargs))
        with contextlib.ExitStack() as stack:
            for device_type in _AUTOCAST_DEVICES:
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            if self.previous is not None:
                return self.previous(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)


def apply_fp32_islands(model: nn.Module, modules: ModuleSpec | Iterable[ModuleSpec] = "preset") -> list[str]:
    """Make the modules ``modules`` selects run in fp32 under autocast; returns their names.

    Args:
        model: any module.
        modules: module classes, dotted class paths and name globs (see
            :mod:`lightning_memopt.selection`), or ``"preset"`` for the islands the model's modules
            declare (:mod:`lightning_memopt.models.structure`: the face margin head and the normal
            head's output conv in the presets; none in a model that declares none).

    Raises:
        ValueError: a spec matches no module (the message lists the classes present); a bad spec.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> apply_fp32_islands(model, "1")
        ['1']
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model(torch.randn(3, 4)).dtype
        torch.float32
    """
    found = _select(model, modules)
    for _, module in found:
        holder, attribute, innermost = _innermost_forward(module)
        if not isinstance(innermost, Fp32Forward):
            _set_forward(module, holder, attribute, Fp32Forward(module, innermost))
    return [name for name, _ in found]


def remove_fp32_islands(model: nn.Module) -> int:
    """Undo :func:`apply_fp32_islands` on every module of ``model``; returns how many were islands."""
    removed = 0
    for module in model.modules():
        holder, attribute, innermost = _innermost_forward(module)
        if isinstance(innermost, Fp32Forward):
            _set_forward(module, holder, attribute, innermost.previous)
            removed += 1
    return removed


def is_fp32_island(module: nn.Module) -> bool:
    """Whether ``module`` runs as an fp32 island."""
    return isinstance(_innermost_forward(module)[2], Fp32Forward)


def _select(model: nn.Module, modules: ModuleSpec | Iterable[ModuleSpec]) -> list[tuple[str, nn.Module]]:
    if isinstance(modules, str) and modules == "preset":
        return model_structure(model).fp32_islands
    specs = normalise_specs(modules, "fp32_modules")
    found = select_modules(model, specs)
    for spec in specs:
        if not select_modules(model, [spec]):
            name = spec if isinstance(spec, str) else spec.__name__
            raise ValueError(f"`fp32_modules` entry {name!r} matches no module; {describe_model(model)}")
    return found


def _innermost_forward(module: nn.Module) -> tuple[Any, str, Any]:
    """``(holder, attribute, value)``: the innermost instance forward, under wrappers that keep a ``previous``."""
    holder: Any = module
    attribute = "forward"
    value = module.__dict__.get("forward")
    while value is not None and not isinstance(value, Fp32Forward) and hasattr(value, "previous"):
        holder, attribute, value = value, "previous", value.previous
    return holder, attribute, value


def _set_forward(module: nn.Module, holder: Any, attribute: str, value: Callable[..., Any] | None) -> None:
    if holder is not module:
        setattr(holder, attribute, value)
    elif value is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = value


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    return value
