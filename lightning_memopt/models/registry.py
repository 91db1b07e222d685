"""Name → constructor registry behind :func:`create_model`.

Every preset is a plain function returning an ``nn.Module``; it allocates nothing beyond what the
module's constructor does, so it also works under ``with torch.device("meta"):``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

_ModelFactory = TypeVar("_ModelFactory", bound=Callable[..., nn.Module])
_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[_ModelFactory], _ModelFactory]:
    """Register ``factory`` as the preset ``name`` (a decorator).

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(factory: _ModelFactory) -> _ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model preset {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_models() -> list[str]:
    """Names of every registered preset, sorted.

    Example::

        >>> "r18" in list_models()
        True
    """
    return sorted(_REGISTRY)


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build the bare network of preset ``name``, with constructor arguments overridden.

    Args:
        name: a preset from :func:`list_models` (``"r18"`` … ``"r200"``, ``"iresnet_tiny"``, …).
        **overrides: keyword arguments passed to the preset's constructor (e.g. ``input_size=32``).

    Raises:
        ValueError: for an unknown ``name``, listing the valid names.

    Example::

        >>> import torch
        >>> with torch.device("meta"):
        ...     net = create_model("r200")
        >>> round(sum(p.numel() for p in net.parameters()) / 1e6, 2)
        118.83
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown model preset `name`={name!r}; valid names: {', '.join(list_models())}") from None
    return factory(**overrides)
