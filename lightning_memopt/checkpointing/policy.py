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
from lightning_memopt.vocabulary import LEAN, POLICY_MODES, PolicyMode

# "auto": the blocks the model declares, else the repeated blocks discovered in it; "preset" is its old name
AUTO = ("auto", "preset")
AutoBlocks = Literal["auto", "preset"]  # == AUTO
KEYWORDS = {
    "auto": "full", "preset": "full", "selective": "selective", "offload": "offload", "lean": LEAN, "every_n": "full"
}  # fmt: skip
PolicyKeyword = Literal["auto", "preset", "selective", "offload", "lean", "every_n"]  # == tuple(KEYWORDS)
POLICY_KEYS = ("modules", "every_n", "mode")
BUDGET_KEYS = ("budget", "modules")
# the ``blocks`` argument: "auto" (declared, else discovered) or module classes, dotted class paths and name globs
BlocksSpec = AutoBlocks | ModuleSpec | Sequence[ModuleSpec] | None


class PolicyMapping(TypedDict, total=False):
    """A :class:`Policy` as a mapping of its arguments (keys == POLICY_KEYS)."""

    modules: AutoBlocks | ModuleSpec | Sequence[ModuleSpec] | None
    every_n: int | Literal["sqrt"] | None
    mode: PolicyMode


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
            recomputes nothing and keeps the saved activations in (pinned) host memory; ``"lean"`` is
            full recomputation by the module's own memory-lean path where it has one (a
            ``checkpointed_forward``: chunks or tiles, less held again in backward for more kernels,
            :class:`~lightning_memopt.models.structure.LeanRecompute`), plain ``"full"`` where it has none.

    Raises:
        ValueError: an unknown ``mode``, an ``every_n`` below 1, or a module spec that is neither a
            class, an importable dotted class path nor a glob.

    Example::

        >>> Policy(modules="backbone.blocks.*", every_n=2).mode
        'full'
    """

    modules: tuple[ModuleSpec, ...] | None = None
    every_n: int | Literal["sqrt"] | None = None
    mode: PolicyMode = "full"

    def __init__(
        self,
        modules: ModuleSpec | Iterable[ModuleSpec] | None = None,
        every_n: int | Literal["sqrt"] | None = None,
        mode: PolicyMode = "full",
    ) -> None:
        if not isinstance(mode, str) or mode not in POLICY_MODES:
            raise ValueError(f"Unknown `mode`={mode!r}; valid choices: {', '.join(POLICY_MODES)}")
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


class BudgetMapping(TypedDict, total=False):
    """An :class:`ActivationBudget` as a mapping (keys == BUDGET_KEYS)."""

    budget: float
    modules: AutoBlocks | ModuleSpec | Sequence[ModuleSpec] | None


@dataclass(frozen=True)
class ActivationBudget:
    """Checkpoint each block in the mode (or not at all) that brings the activation peak within ``budget`` fastest.

    The choice needs a measured step: the :class:`~lightning_memopt.ActivationCheckpointing` callback
    profiles the first training batch in fake mode and solves the checkpointing knapsack
    (:func:`~lightning_memopt.planner.plan_checkpointing` does it outside a Trainer).

    Args:
        budget: a fraction in (0, 1] of the activation peak without checkpointing, or bytes (above 1).
        modules: the blocks to choose for, as :class:`Policy` takes them (``None``: the model's blocks).

    Raises:
        ValueError: a ``budget`` that is no positive number.

    Example::

        >>> ActivationBudget(0.4).describe()
        'budget(0.4 of the activation peak, auto)'
    """

    budget: float
    modules: tuple[ModuleSpec, ...] | None = None

    def __init__(self, budget: float, modules: ModuleSpec | Iterable[ModuleSpec] | None = None) -> None:
        object.__setattr__(self, "budget", check_budget(budget))
        object.__setattr__(self, "modules", _normalise_modules(modules))

    def describe(self) -> str:
        names = "auto" if self.modules is None else ", ".join(spec_name(spec) for spec in self.modules)
        amount = f"{self.budget} of the activation peak" if self.budget <= 1 else f"{int(self.budget)} bytes"
        return f"budget({amount}, {names})"


def check_budget(budget: Any) -> float:
    """``budget``: a fraction in (0, 1] of the activation peak without checkpointing, or a number of bytes above 1.

    Raises:
        ValueError: not a positive, finite number (a bool neither).

    Example::

        >>> check_budget(0.25), check_budget(2**30)
        (0.25, 1073741824)
    """
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < math.inf:
        raise ValueError(
            f"`budget`={budget!r} must be a fraction in (0, 1] of the activation peak without checkpointing, or a "
            "number of bytes above 1"
        )
    return budget


# what parse_policy takes: a keyword, a module class, dotted class path or name glob, a mapping, a Policy, or a list
PolicyItem = PolicyKeyword | ModuleSpec | PolicyMapping | BudgetMapping | Policy | ActivationBudget
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


def parse_policy(spec: PolicySpec) -> tuple[Policy, ...] | tuple[ActivationBudget]:
    """Turn a policy given as an object, string, class, mapping or list of those into policies.

    Strings: ``"auto"`` (full recomputation of the model's declared, else discovered, blocks;
    ``"preset"`` is the same), ``"selective"``, ``"offload"``, ``"lean"`` (those modes on the same blocks),
    ``"every_n"`` (every n-th of L sibling blocks, n = √L rounded), a dotted class path, or a
    module-name glob. A mapping holds :class:`Policy`
    arguments; ``{"budget": b}`` (and optionally ``"modules"``) is an :class:`ActivationBudget`, which
    stands alone. A list composes: the first policy to match a module decides how it is wrapped.

    Raises:
        ValueError: an empty list, unknown mapping keys, a bad :class:`Policy` argument or budget, or a
            budget in a list.
        TypeError: a value of any other type.

    Example::

        >>> [p.describe() for p in parse_policy(["fnet", {"modules": "updateformer.*", "mode": "offload"}])]
        ['full(fnet)', 'offload(updateformer.*)']
    """
    if isinstance(spec, Policy | ActivationBudget):
        return (spec,)
    if isinstance(spec, str):
        if spec in KEYWORDS:
            return (Policy(None, every_n="sqrt" if spec == "every_n" else None, mode=KEYWORDS[spec]),)
        return (Policy(spec),)
    if isinstance(spec, type):
        return (Policy(spec),)
    if isinstance(spec, Mapping) and "budget" in spec:
        unknown = sorted(set(spec) - set(BUDGET_KEYS))
        if unknown:
            raise ValueError(f"Unknown budget policy keys {unknown}; valid keys: {', '.join(BUDGET_KEYS)}")
        return (ActivationBudget(spec["budget"], spec.get("modules")),)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(POLICY_KEYS))
        if unknown:
            raise ValueError(f"Unknown policy keys {unknown}; valid keys: {', '.join(POLICY_KEYS)}")
        modules = spec.get("modules")
        return (Policy(modules, spec.get("every_n"), spec.get("mode", "full")),)
    if isinstance(spec, Sequence):
        if not spec:
            raise ValueError("`policy` is an empty list; give at least one policy")
        policies = tuple(policy for item in spec for policy in parse_policy(item))
        if any(isinstance(policy, ActivationBudget) for policy in policies):
            raise ValueError(
                f"`policy`={spec!r}: a {{'budget': ...}} policy chooses every block's mode itself; give it alone"
            )
        return policies  # type: ignore[return-value]  (no budget among them)
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
