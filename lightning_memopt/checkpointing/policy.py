"""Checkpointing policies: which modules to wrap, and how (full recompute, selective, offload).

A policy is built from Hydra-friendly values as well as Python objects; :func:`parse_policy`
turns any of them into an ordered tuple of :class:`Policy`, and :meth:`Policy.matches` finds the
modules each one selects in a model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from typing_extensions import TypedDict

from lightning_memopt.arguments import check_int
from lightning_memopt.models.structure import model_structure
from lightning_memopt.selection import ModuleSpec, normalise_specs, select_modules, spec_name
from lightning_memopt.vocabulary import CHECKPOINT_MODES, CheckpointMode

# "auto": the blocks the model declares, else the repeated blocks discovered in it; "preset" is its old name
AUTO = ("auto", "preset")
AutoBlocks = Literal["auto", "preset"]  # == AUTO
KEYWORDS = {"auto": "full", "preset": "full", "selective": "selective", "offload": "offload", "every_n": "full"}
PolicyKeyword = Literal["auto", "preset", "selective", "offload", "every_n"]  # == tuple(KEYWORDS)
POLICY_KEYS = ("modules", "every_n", "mode")
# the ``blocks`` argument: "auto" (declared, else discovered) or module classes, dotted class paths and name globs
BlocksSpec = AutoBlocks | ModuleSpec | Sequence[ModuleSpec] | None


class PolicyMapping(TypedDict, total=False):
    """A :class:`Policy` as a mapping of its arguments (keys == POLICY_KEYS)."""

    modules: AutoBlocks | ModuleSpec | Sequence[ModuleSpec] | None
    every_n: int | Literal["sqrt"] | None
    mode: CheckpointMode


@dataclass(frozen=True)
class Policy:
    """Which modules to checkpoint, and how.

    Args:
        modules: module classes (objects or dotted paths) and module-name globs; ``None``, ``"auto"``
            or ``"preset"`` for the model's blocks: those its modules declare
            (:mod:`lightning_memopt.models.structure`), and the repeated blocks discovered where
            nothing is declared (:mod:`lightning_memopt.models.discovery`). A glob matches the end of a module's dotted
            name segment by segment (``*`` stays within one segment, ``**`` spans several), so
            ``"fnet"`` finds ``model.fnet`` and ``"updateformer.time_blocks.*"`` each time block.
        every_n: wrap only blocks ``0, n, 2n, …`` of each run of sibling matches (the matches of
            one class in one container); ``"sqrt"`` picks ``n ≈ √L`` for ``L`` siblings, about √L
            checkpoints (Chen et al. 2016); ``None`` wraps every match.
        mode: ``"full"`` recomputes the whole forward in the backward pass; ``"selective"`` saves the
            outputs of matmul, convolution and attention ops and recomputes the rest; ``"offload"``
            recomputes nothing and keeps the saved activations in (pinned) host memory.

    Raises:
        ValueError: an unknown ``mode``, an ``every_n`` below 1, or a module spec that is neither a
            class, an importable dotted class path nor a glob.

    Example::

        >>> Policy(modules="backbone.blocks.*", every_n=2).mode
        'full'
    """

    modules: tuple[ModuleSpec, ...] | None = None
    every_n: int | Literal["sqrt"] | None = None
    mode: CheckpointMode = "full"

    def __init__(
        self,
        modules: ModuleSpec | Iterable[ModuleSpec] | None = None,
        every_n: int | Literal["sqrt"] | None = None,
        mode: CheckpointMode = "full",
    ) -> None:
        if not isinstance(mode, str) or mode not in CHECKPOINT_MODES:
            raise ValueError(f"Unknown `mode`={mode!r}; valid choices: {', '.join(CHECKPOINT_MODES)}")
        if every_n is not None and every_n != "sqrt":
            try:
                every_n = check_int("every_n", every_n, minimum=1)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`every_n` must be an integer ≥ 1, 'sqrt' or None, got {every_n!r} ({type(every_n).__name__})"
                ) from None
        object.__setattr__(self, "modules", _normalise_modules(modules))
        object.__setattr__(self, "every_n", every_n)
        object.__setattr__(self, "mode", mode)

    def describe(self) -> str:
        """A short, readable form: ``full(auto, every_n=2)``."""
        names = "auto" if self.modules is None else ", ".join(spec_name(spec) for spec in self.modules)
        return f"{self.mode}({names}" + (f", every_n={self.every_n}" if self.every_n is not None else "") + ")"

    def matches(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs of ``model`` this policy selects, in module order."""
        found = model_structure(model).blocks if self.modules is None else select_modules(model, self.modules)
        return found if self.every_n is None else _every_nth_sibling(found, self.every_n)


# what parse_policy takes: a keyword, a module class, dotted class path or name glob, a mapping, a Policy, or a list
PolicyItem = PolicyKeyword | ModuleSpec | PolicyMapping | Policy
PolicySpec = PolicyItem | Sequence[PolicyItem]


def check_blocks(blocks: Any) -> None:
    """Check the ``blocks`` argument of the planner: ``"auto"`` or module classes, dotted paths and name globs.

    Raises:
        ValueError: naming ``blocks``, the bad value and the valid choices.

    Example::

        >>> check_blocks(["encoder.layers.*", "torch.nn.TransformerEncoderLayer"])
    """
    if blocks is None or (isinstance(blocks, str) and blocks in AUTO):
        return
    if not isinstance(blocks, str | type | Iterable):
        raise ValueError(
            f"`blocks`={blocks!r} must be 'auto' (the blocks the model declares, else those discovered), or module "
            "classes, dotted class paths and name globs"
        )
    normalise_specs(blocks, "blocks")


def parse_policy(spec: PolicySpec) -> tuple[Policy, ...]:
    """Turn a policy given as an object, string, class, mapping or list of those into policies.

    Strings: ``"auto"`` (full recomputation of the model's declared, else discovered, blocks;
    ``"preset"`` is the same), ``"selective"``, ``"offload"`` (those modes on the same blocks),
    ``"every_n"`` (every n-th of L sibling blocks, n = √L rounded), a dotted class path, or a
    module-name glob. A mapping holds :class:`Policy`
    arguments. A list composes: the first policy to match a module decides how it is wrapped.

    Raises:
        ValueError: an empty list, unknown mapping keys, or a bad :class:`Policy` argument.
        TypeError: a value of any other type.

    Example::

        >>> [p.describe() for p in parse_policy(["fnet", {"modules": "updateformer.*", "mode": "offload"}])]
        ['full(fnet)', 'offload(updateformer.*)']
    """
    if isinstance(spec, Policy):
        return (spec,)
    if isinstance(spec, str):
        if spec in KEYWORDS:
            return (Policy(None, every_n="sqrt" if spec == "every_n" else None, mode=KEYWORDS[spec]),)
        return (Policy(spec),)
    if isinstance(spec, type):
        return (Policy(spec),)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(POLICY_KEYS))
        if unknown:
            raise ValueError(f"Unknown policy keys {unknown}; valid keys: {', '.join(POLICY_KEYS)}")
        modules = spec.get("modules")
        return (Policy(modules, spec.get("every_n"), spec.get("mode", "full")),)
    if isinstance(spec, Sequence):
        if not spec:
            raise ValueError("`policy` is an empty list; give at least one policy")
        return tuple(policy for item in spec for policy in parse_policy(item))
    raise TypeError(
        f"`policy`={spec!r} must be a Policy, a string, a module class, a mapping of {', '.join(POLICY_KEYS)}, "
        "or a list of those"
    )


def _normalise_modules(modules: ModuleSpec | Iterable[ModuleSpec] | None) -> tuple[ModuleSpec, ...] | None:
    if modules is None or (isinstance(modules, str) and modules in AUTO):
        return None
    return normalise_specs(modules)


def _every_nth_sibling(found: list[tuple[str, nn.Module]], every_n: int | str) -> list[tuple[str, nn.Module]]:
    groups: dict[tuple[str, type], list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, module in found:  # a run: the matches of one class in one container
        groups[name.rpartition(".")[0], type(module)].append((name, module))
    kept = []
    for siblings in groups.values():
        step = max(1, round(math.sqrt(len(siblings)))) if every_n == "sqrt" else int(every_n)
        kept += siblings[::step]
    order = {name: index for index, (name, _) in enumerate(found)}
    return sorted(kept, key=lambda item: order[item[0]])
