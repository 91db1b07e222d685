"""How a model declares its memory structure, and how the generic layers read it.

A module declares, for memory purposes, what the generic layers would otherwise have to know by
class name: its repeated blocks (the units activation checkpointing, host offload and FSDP act
on), its fp32 islands (submodules whose numerics want fp32 under autocast), and where it keeps its
attention kernel. It does so with a ``memory_structure()`` method returning a
:class:`MemoryStructure`. :func:`model_structure` collects the declarations of every module in a
model, and fills the parts no module declares with the repeated blocks that
:func:`~lightning_memopt.models.discovery.discover_blocks` finds, so any ``nn.Module`` has a structure.

A block may also say how to recompute itself leanly: a method ``checkpointed_forward(*args,
**kwargs)`` returning what ``forward`` returns, but keeping nothing for backward except its inputs
(it checkpoints its own pieces). Checkpointed in ``"lean"`` mode it then runs instead of the
plain recomputation (not while compiling, nor for a block holding batch norms that track running
statistics); ``"full"`` recomputes such a block plainly too. The normal head's stages compute in
channel chunks and its 1×1 chain over tiles of rows this way (:mod:`~lightning_memopt.models.piecewise_recompute`,
:mod:`~lightning_memopt.models.tiled_chain`). Its ``lean_recompute()`` says what the lean path costs next to
the plain one (a :class:`LeanRecompute`, read by :func:`lean_recompute`); an activation budget's planner weighs
both (:func:`~lightning_memopt.planner.plan_checkpointing`).

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3))
    ...         self.head = nn.Linear(4, 2)
    ...     def memory_structure(self):
    ...         return MemoryStructure(blocks=self.layers, fp32_islands=[self.head])
    >>> structure = model_structure(Net())
    >>> structure.block_names, structure.island_names
    (['layers.0', 'layers.1', 'layers.2'], ['head'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import nn

from lightning_memopt.models.discovery import discover_blocks, outermost
from lightning_memopt.vocabulary import ATTENTION_IMPLS


def check_attn_impl(attn_impl: object) -> str:
    """Return ``attn_impl`` if it is one of :data:`ATTENTION_IMPLS`.

    Raises:
        ValueError: naming the bad value and the choices.

    Example::

        >>> check_attn_impl("math")
        'math'
    """
    if attn_impl not in ATTENTION_IMPLS:
        raise ValueError(f"Unknown `attn_impl`={attn_impl!r}; valid choices: {', '.join(ATTENTION_IMPLS)}")
    return attn_impl  # type: ignore[return-value]


@dataclass(frozen=True)
class AttentionSwitch:
    """Where a module keeps its attention kernel: the string attribute ``attribute`` of ``module``.

    Example::

        >>> holder = nn.Module()
        >>> holder.attn_impl = "sdpa"
        >>> switch = AttentionSwitch(holder)
        >>> switch.set("math"); switch.get()
        'math'
    """

    module: nn.Module
    attribute: str = "attn_impl"

    def get(self) -> str:
        """The kernel in use."""
        return getattr(self.module, self.attribute)

    def set(self, attn_impl: str) -> None:
        """Switch to ``attn_impl`` (one of :data:`ATTENTION_IMPLS`)."""
        setattr(self.module, self.attribute, check_attn_impl(attn_impl))


@dataclass(frozen=True)
class MemoryStructure:
    """What one module declares about itself; every field is optional.

    Args:
        blocks: its repeated blocks, the units of checkpointing, offload and FSDP sharding (one
            with a ``checkpointed_forward`` method recomputes by it under ``"lean"`` checkpointing).
            ``None`` declares nothing (its submodules are searched for repeated blocks); an empty
            sequence declares that it has none worth wrapping.
        fp32_islands: submodules that should run in fp32 under autocast.
        attention: where the module keeps its attention kernel, if it has one.
    """

    blocks: Sequence[nn.Module] | None = None
    fp32_islands: Sequence[nn.Module] = ()
    attention: AttentionSwitch | None = None


@runtime_checkable
class DeclaresMemoryStructure(Protocol):
    """A module that declares its memory structure."""

    def memory_structure(self) -> MemoryStructure: ...


@dataclass
class ModelStructure:
    """A whole model's structure: declared where modules declare it, discovered elsewhere.

    ``blocks`` never nest (the outermost of nested candidates is kept) and are in module order;
    ``discovered`` names those that no module declared.
    """

    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)
    discovered: list[str] = field(default_factory=list)
    fp32_islands: list[tuple[str, nn.Module]] = field(default_factory=list)
    attention: list[tuple[str, AttentionSwitch]] = field(default_factory=list)

    @property
    def block_names(self) -> list[str]:
        return [name for name, _ in self.blocks]

    @property
    def island_names(self) -> list[str]:
        return [name for name, _ in self.fp32_islands]

    @property
    def source(self) -> str:
        """Where the blocks come from: ``"declared"``, ``"discovered"`` or ``"N declared, M discovered"``."""
        discovered = len(self.discovered)
        declared = len(self.blocks) - discovered
        if declared and discovered:
            return f"{declared} declared, {discovered} discovered"
        return "discovered" if discovered else "declared"

    def describe_blocks(self) -> str:
        """``"30 blocks (IBasicBlock ×30; declared)"``, or ``"no blocks"``."""
        if not self.blocks:
            return "no blocks"
        counts: dict[str, int] = {}
        for _, module in self.blocks:
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
        listed = ", ".join(f"{name} ×{count}" for name, count in counts.items())
        return f"{len(self.blocks)} blocks ({listed}; {self.source})"


def model_structure(model: nn.Module) -> ModelStructure:
    """Collect the memory structure of ``model``: every module's declaration, and discovered blocks elsewhere.

    Blocks come from the modules that declare them; the subtrees of those modules are not
    searched further. The rest of the model is searched by
    :func:`~lightning_memopt.models.discovery.discover_blocks`. fp32 islands and attention
    switches come from declarations only.

    Raises:
        ValueError: a module declares a submodule that is not part of ``model``.
    """
    names = {id(module): name for name, module in model.named_modules()}
    structure = ModelStructure()
    declared: list[tuple[str, nn.Module]] = []
    owners: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, DeclaresMemoryStructure):
            continue
        declaration = module.memory_structure()
        if declaration.blocks is not None:
            owners.append(name)
            declared += [(_name_of(block, names, name, "blocks"), block) for block in declaration.blocks]
        structure.fp32_islands += [
            (_name_of(island, names, name, "fp32_islands"), island) for island in declaration.fp32_islands
        ]
        if declaration.attention is not None:
            structure.attention.append((name, declaration.attention))
    discovered = discover_blocks(model, skip=owners)
    order = {name: index for index, name in enumerate(names.values())}
    structure.blocks = sorted(outermost(declared + discovered), key=lambda item: order[item[0]])
    found = {name for name, _ in discovered}
    structure.discovered = [name for name, _ in structure.blocks if name in found]
    return structure


def _name_of(module: nn.Module, names: dict[int, str], owner: str, field_name: str) -> str:
    try:
        return names[id(module)]
    except KeyError:
        raise ValueError(
            f"module {owner or '(root)'!r} declares in `{field_name}` a {type(module).__name__} that is not one of "
            "the model's submodules"
        ) from None


def attention_kernels(model: nn.Module) -> dict[str, str]:
    """The attention kernel of every module of ``model`` that declares one, by module name.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> attention_kernels(create_model("sapiens_tiny", depth=1))
        {'backbone.blocks.0.attn': 'sdpa'}
    """
    return {name: switch.get() for name, switch in model_structure(model).attention}


def set_attention(model: nn.Module, attn_impl: str | Mapping[str, str] | None) -> int:
    """Switch the attention kernel of every module that declares one; returns how many were switched.

    Args:
        model: any module; those without a declared attention switch are left alone.
        attn_impl: one of :data:`ATTENTION_IMPLS` for all of them, a mapping from module name to
            kernel (as :func:`attention_kernels` returns, to restore them), or ``None`` for none.

    Raises:
        ValueError: an unknown kernel.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> model = create_model("sapiens_tiny", depth=2)
        >>> before = attention_kernels(model)
        >>> set_attention(model, "math"), set(attention_kernels(model).values())
        (2, {'math'})
        >>> set_attention(model, before), attention_kernels(model) == before
        (2, True)
    """
    if attn_impl is None:
        return 0
    if isinstance(attn_impl, str):
        check_attn_impl(attn_impl)
    switched = 0
    for name, switch in model_structure(model).attention:
        kernel = attn_impl if isinstance(attn_impl, str) else attn_impl.get(name)
        if kernel is not None:
            switch.set(kernel)
            switched += 1
    return switched


@dataclass(frozen=True)
class LeanRecompute:
    """What a block's ``checkpointed_forward`` costs next to plain full checkpointing.

    Args:
        held_fraction: of the bytes the block saves without checkpointing, the most its backward holds
            again at once (plain checkpointing: 1; ``n`` chunks: about 1/n).
        forwards: its forward work run again, counted in forwards (plain checkpointing: 1; a tiled
            chain that recomputes its statistics in several passes: more).

    Example::

        >>> LeanRecompute(held_fraction=1 / 8, forwards=1.0).held_fraction
        0.125
    """

    held_fraction: float
    forwards: float

    @property
    def cut(self) -> bool:
        """Whether it differs from plain checkpointing (in one piece, one forward, it is the plain one).

        Example::

            >>> LeanRecompute(held_fraction=1.0, forwards=1.0).cut, LeanRecompute(held_fraction=0.5, forwards=1.0).cut
            (False, True)
        """
        return (self.held_fraction, self.forwards) != (1.0, 1.0)


def lean_recompute(module: nn.Module) -> LeanRecompute | None:
    """The cost ``module``'s own ``checkpointed_forward`` declares, or None (it has none: plain checkpointing).

    Example::

        >>> lean_recompute(nn.Linear(2, 2)) is None
        True
    """
    declared = getattr(module, "lean_recompute", None)
    if not callable(getattr(module, "checkpointed_forward", None)) or not callable(declared):
        return None
    cost = declared()
    if not isinstance(cost, LeanRecompute):
        raise TypeError(f"{type(module).__name__}.lean_recompute() must return a LeanRecompute, got {cost!r}")
    return cost
