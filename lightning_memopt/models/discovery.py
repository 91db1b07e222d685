"""Find the repeated blocks of any ``nn.Module``: the units worth checkpointing, offloading or sharding.

A *run* is two or more sibling modules of one class: consecutive children of a ``ModuleList`` or
``Sequential`` (a transformer's layers, a CNN stage's residual blocks), or same-class children of
any other module (two ``Block`` attributes; plain ``Sequential`` attributes only when named as a
numbered series, ``layer1`` … ``layer4``, since any two parts may share that class). A run's
members must be blocks, not single layers: modules with submodules, parameters and a ``forward``
of their own (a ``ModuleList`` or ``ModuleDict`` only holds others).

The outermost runs are taken and never nested. One exception keeps the units useful: a short run
(at most :data:`SHORT_RUN` members, the stages of a CNN) whose members are built mostly (at least
half their parameters) of longer runs of blocks, each with two weight layers or more, gives way to
those inner runs, so a ResNet's four stages become its residual blocks rather than four
checkpoints of a whole stage each.

Example::

    >>> from torch import nn
    >>> model = nn.Module()
    >>> model.stem = nn.Linear(2, 8)
    >>> model.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(4))
    >>> [name for name, _ in discover_blocks(model)]
    ['layers.0', 'layers.1', 'layers.2', 'layers.3']
"""

from __future__ import annotations

import re
from collections.abc import Collection

from torch import nn

SHORT_RUN = 4  # a run this short may be a CNN's stages: its members' inner blocks can take its place

Named = list[tuple[str, nn.Module]]


def discover_blocks(model: nn.Module, skip: Collection[str] = ()) -> Named:
    """The repeated blocks of ``model``, outermost first and never nested, as ``(name, module)`` in module order.

    Args:
        model: any module.
        skip: names of submodules whose subtrees are not searched (those that declare their blocks).
    """
    found = _search(model, "", set(skip), descend=True)
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda item: order[item[0]])


def outermost(found: Named) -> Named:
    """``found`` without the modules that lie inside another of them (and without repeats)."""
    names = {name for name, _ in found}
    kept, seen = [], set()
    for name, module in found:
        inside = any(name.startswith(other + ".") for other in names if other != name)
        if name not in seen and not inside:
            kept.append((name, module))
            seen.add(name)
    return kept


def _search(module: nn.Module, prefix: str, skip: set[str], descend: bool) -> Named:
    if prefix in skip:
        return []
    found: Named = []
    taken: set[str] = set()
    for run in _runs(module, prefix, skip):
        taken.update(name for name, _ in run)
        inner = _inner_blocks(run, skip) if descend and len(run) <= SHORT_RUN else []
        found += inner or run
    for name, child in module.named_children():
        full = _join(prefix, name)
        if full not in taken:
            found += _search(child, full, skip, descend)
    return found


def _inner_blocks(run: Named, skip: set[str]) -> Named:
    """The outermost runs inside a short run's members, when they hold its bulk and are blocks of several layers."""
    inner = [block for name, member in run for block in _search(member, name, skip, descend=False)]
    if len(inner) <= len(run) or not all(_weight_layers(module) >= 2 for _, module in inner):
        return []
    if 2 * _parameters(inner) < _parameters(run):
        return []
    return inner


def _runs(module: nn.Module, prefix: str, skip: set[str]) -> list[Named]:
    children = [(_join(prefix, name), child) for name, child in module.named_children()]
    groups: list[Named] = []
    if isinstance(module, nn.Sequential | nn.ModuleList):  # ordered: runs of consecutive same-class children
        for name, child in children:
            if groups and type(groups[-1][-1][1]) is type(child):
                groups[-1].append((name, child))
            else:
                groups.append([(name, child)])
    else:
        by_kind: dict[tuple[type, str], Named] = {}
        for name, child in children:
            local = name.rpartition(".")[2]
            series = re.sub(r"\d+$", "", local)
            if type(child) is nn.Sequential and series == local:
                continue  # a plain Sequential outside a numbered series: a part, not a repeat
            key = (type(child), series if type(child) is nn.Sequential else "")
            by_kind.setdefault(key, []).append((name, child))
        groups = list(by_kind.values())
    return [group for group in groups if len(group) >= 2 and all(_is_block(n, m, skip) for n, m in group)]


def _is_block(name: str, module: nn.Module, skip: set[str]) -> bool:
    if name in skip or type(module).forward is nn.Module.forward:  # no forward: a ModuleList, a ModuleDict
        return False
    return next(module.children(), None) is not None and next(module.parameters(), None) is not None


def _weight_layers(module: nn.Module) -> int:
    """How many weight matrices or kernels ``module`` holds: 1 for a conv-norm-activation layer, more for a block."""
    return sum(1 for parameter in module.parameters() if parameter.dim() >= 2)


def _parameters(found: Named) -> int:
    return sum(parameter.numel() for _, module in found for parameter in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
