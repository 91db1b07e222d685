"""Shard a model with FSDP2: one ``fully_shard`` unit per block, then one per top-level module holding the rest.

The blocks are those the model declares, else the repeated blocks discovered in it
(:func:`~lightning_memopt.models.structure.model_structure`), or those ``blocks`` selects; a
block without parameters is no unit. A LightningModule is never a unit itself: Lightning calls
its ``training_step``, not its ``forward``, so the parameters of a unit at its root would never be
gathered. Its direct children holding parameters outside the blocks are the top-level units
(the items of a ``ModuleList`` / ``ModuleDict``, which have no ``forward`` of their own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from lightning_memopt.models.structure import model_structure
from lightning_memopt.selection import ModuleSpec, normalise_specs, select_modules

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class ShardingError(ValueError):
    """The model cannot be sharded as asked: ``blocks`` match nothing, or a parameter has no unit to live in."""


def shard_units(module: nn.Module, blocks: ModuleSpec | Iterable[ModuleSpec] = "auto") -> list[tuple[str, nn.Module]]:
    """The modules ``fully_shard`` is applied to, innermost first: the blocks, then the top-level units.

    Args:
        module: the model, or a LightningModule (then its root is no unit: see the module docstring).
        blocks: ``"auto"`` (declared, else discovered), or module classes, dotted paths and name globs.

    Raises:
        ShardingError: ``blocks`` that match no module, or parameters held directly by a
            LightningModule (no submodule's ``forward`` gathers them).

    Example::

        >>> from lightning_memopt.models import create_model
        >>> names = [name for name, _ in shard_units(create_model("sapiens_tiny"))]
        >>> names[:2], names[-1]
        (['backbone.blocks.0', 'backbone.blocks.1'], '')
    """
    if blocks == "auto":
        found = model_structure(module).blocks
    else:
        found = select_modules(module, normalise_specs(blocks, "blocks"))
        if not found:
            raise ShardingError(f"`blocks`={blocks!r} match no module of {type(module).__name__}")
    units = [(name, block) for name, block in found if _holds_parameters(block)]
    covered = {id(p) for _, block in units for p in block.parameters()}
    for name, top in _top_level(module):
        if any(id(p) not in covered for p in top.parameters()):
            units.append((name, top))
    return units


def shard_model(
    module: nn.Module, blocks: ModuleSpec | Iterable[ModuleSpec] = "auto", **fully_shard_options: Any
) -> list[str]:
    """Apply ``torch.distributed.fsdp.fully_shard`` to each of :func:`shard_units`; returns the units' names.

    ``fully_shard_options`` go to every call (``mesh``, ``mp_policy``, ``offload_policy``,
    ``reshard_after_forward``). Needs an initialised process group.
    """
    from torch.distributed.fsdp import fully_shard

    units = shard_units(module, blocks)
    for _, unit in units:
        fully_shard(unit, **fully_shard_options)
    return [name for name, _ in units]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _top_level(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The root, or for a LightningModule its children (container items), once it is known to hold no parameter."""
    from lightning.pytorch import LightningModule

    if not isinstance(module, LightningModule):
        return [("", module)]
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ShardingError(
            f"{type(module).__name__} holds parameters directly ({', '.join(own)}): under fsdp_memopt every parameter "
            "must live in a submodule whose forward is called, so that FSDP gathers it; move them into one"
        )
    units: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            units.extend((f"{name}.{item}", grandchild) for item, grandchild in child.named_children())
            if any(True for _ in child.parameters(recurse=False)):
                raise ShardingError(f"`{name}` ({type(child).__name__}) holds parameters no forward gathers")
        elif _holds_parameters(child):
            units.append((name, child))
    return units
