"""What a block's traced graphs depend on besides its tensors' values: its structure and its call's form.

A trace holds what the forward read in Python: the classes and plain attributes of the modules inside the block
and the call's arguments other than tensors. Two calls may share a trace where those are equal and the tensors
(parameters, buffers, inputs) have the same shapes, strides, dtypes, devices and gradient flags, under the same
autocast. What cannot be compared (a tensor kept as a plain attribute, an object without equality) cannot be keyed,
so such a block is not traced.

Example::

    >>> import torch
    >>> x = torch.ones(2)
    >>> tensors, form = call_form((x,), {"scale": 0.5, "mask": None})
    >>> len(tensors), rebuild_call(form, tensors)[1]
    (1, {'scale': 0.5, 'mask': None})
    >>> block_structure(torch.nn.Linear(2, 2)) is not None
    True
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch import nn

from lightning_memopt.private_api import composable_state_keys, tree_flatten, tree_unflatten

_PRIMITIVES = (bool, int, float, str, type(None), torch.dtype, torch.device)
_TENSOR = object()  # where a call's tensor goes among its other arguments


def call_form(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[tuple[torch.Tensor, ...], Any] | None:
    """The tensors of a call, and the rest of it (``None`` for a call of tensors alone); ``None`` where the rest cannot
    stand in a key, or where one tensor needing gradients is passed twice (its gradients would sum otherwise)."""
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
        tensors, form = args, None
    else:
        leaves, spec = tree_flatten((args, kwargs or {}))
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        constants = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        if not all(map(_comparable, constants)):
            return None
        form = (spec, tuple(map(_typed, constants)))
    needing = [id(tensor) for tensor in tensors if tensor.requires_grad]
    return (tensors, form) if len(set(needing)) == len(needing) else None


def rebuild_call(form: Any, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(args, kwargs)`` of a call of ``form`` (see :func:`call_form`) with these tensors."""
    if form is None:
        return tensors, {}
    spec, constants = form
    given = iter(tensors)
    return tree_unflatten([next(given) if value is _TENSOR else value for _, value in constants], spec)


def block_structure(module: nn.Module) -> tuple | None:
    """What a traced graph of ``module`` depends on besides tensor shapes and training flags: each module's class
    and plain attributes; ``None`` where something inside cannot be traced or compared."""
    parts: list[Any] = []
    for name, inner in module.named_modules():
        attributes = []
        for attribute, value in vars(inner).items():
            if attribute in _MODULE_INTERNALS or (inner is module and attribute == "forward"):
                continue  # the block's own instance forward is the checkpointing's
            if isinstance(value, torch.Tensor) or attribute == "forward":
                return None  # a tensor the trace would hold as a constant; a forward patched on a module inside
            if not _comparable(value):
                return None
            attributes.append((attribute, _typed(value)))
        parts.append((name, type(inner), tuple(attributes)))
    return tuple(parts)


def _comparable(value: Any) -> bool:
    """Whether ``value`` can stand in a key: plain values, frozen dataclasses and enums of them, and functions and
    classes (by identity)."""
    if value is _TENSOR or isinstance(value, (*_PRIMITIVES, enum.Enum)):
        return True
    if isinstance(value, (tuple, list)):
        return all(map(_comparable, value))
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        return all(_comparable(getattr(value, field.name)) for field in dataclasses.fields(value))
    return callable(value) and getattr(value, "__module__", None) is not None


def _typed(value: Any) -> Any:
    """``value`` as a key: lists as tuples, each plain value beside its type (``1``, ``1.0`` and ``True`` are equal
    keys otherwise, and trace otherwise)."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_typed, value))
    return type(value), value


# what every module holds (its tensors, children and hooks) and what FSDP2 keeps on the modules it shards
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | composable_state_keys()


def tensor_metas(tensors: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad, type(t)) for t in tensors)


def autocast_state(tensors: tuple[torch.Tensor, ...]) -> tuple:
    kinds = sorted({t.device.type for t in tensors} | {"cpu"})
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds)
