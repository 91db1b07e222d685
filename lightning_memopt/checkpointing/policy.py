"""Checkpointing policies: which modules to wrap, and how (full recompute, selective, offload).

A policy is built from Hydra-friendly values as well as Python objects; :func:`parse_policy`
turns any of them into an ordered tuple of :class:`Policy`, and :meth:`Policy.matches` finds the
modules each one selects in a model.
"""

from __future__ import annotations

import fnmatch
import importlib
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

MODES = ("full", "selective", "offload")
KEYWORDS = {"preset": "full", "selective": "selective", "offload": "offload", "every_n": "full"}
POLICY_KEYS = ("modules", "every_n", "mode")
# the blocks worth checkpointing in each preset family (dotted paths, imported when first needed)
PRESET_BLOCKS = (
    "lightning_memopt.models.iresnet.IBasicBlock",
    "lightning_memopt.models.vit.ViTBlock",
    "lightning_memopt.models.normal_head.ConvNormAct",
    "lightning_memopt.models.cotracker.fnet.BasicEncoder",
    "lightning_memopt.models.cotracker.correlation.FullCorrelation",
    "lightning_memopt.models.cotracker.correlation.LocalCorrelation",
    "lightning_memopt.models.cotracker.updateformer.AttentionBlock",
)
# components that wrappers (FSDP, torch's checkpoint wrapper, torch.compile) insert into module names
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

ModuleSpec = str | type[nn.Module]


@dataclass(frozen=True)
class Policy:
    """Which modules to checkpoint, and how.

    Args:
        modules: module classes (objects or dotted paths) and module-name globs; ``None`` or
            ``"preset"`` for :data:`PRESET_BLOCKS`. A glob matches the end of a module's dotted
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
    every_n: int | str | None = None
    mode: str = "full"

    def __init__(
        self,
        modules: ModuleSpec | Iterable[ModuleSpec] | None = None,
        every_n: int | str | None = None,
        mode: str = "full",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"Unknown `mode`={mode!r}; valid choices: {', '.join(MODES)}")
        if every_n is not None and every_n != "sqrt" and (isinstance(every_n, bool) or not isinstance(every_n, int)):
            raise ValueError(f"`every_n`={every_n!r} must be a positive int, 'sqrt' or None")
        if isinstance(every_n, int) and every_n < 1:
            raise ValueError(f"`every_n`={every_n!r} must be at least 1")
        object.__setattr__(self, "modules", _normalise_modules(modules))
        object.__setattr__(self, "every_n", every_n)
        object.__setattr__(self, "mode", mode)

    def describe(self) -> str:
        """A short, readable form: ``full(preset, every_n=2)``."""
        names = "preset" if self.modules is None else ", ".join(_spec_name(spec) for spec in self.modules)
        return f"{self.mode}({names}" + (f", every_n={self.every_n}" if self.every_n is not None else "") + ")"

    def matches(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs of ``model`` this policy selects, in module order."""
        specs = self.modules if self.modules is not None else tuple(resolve_class(path) for path in PRESET_BLOCKS)
        classes = tuple(spec for spec in specs if isinstance(spec, type))
        globs = [spec.split(".") for spec in specs if isinstance(spec, str)]
        found = []
        for name, module in model.named_modules():
            segments = [part for part in name.split(".") if part and part not in _WRAPPER_NAMES]
            if not segments or type(module).__name__ in ("CheckpointWrapper", "FullyShardedDataParallel"):
                continue
            if isinstance(module, classes) or any(_glob_matches_end(pattern, segments) for pattern in globs):
                found.append((name, module))
        return found if self.every_n is None else _every_nth_sibling(found, self.every_n)


def parse_policy(spec: Any) -> tuple[Policy, ...]:
    """Turn a policy given as an object, string, class, mapping or list of those into policies.

    Strings: ``"preset"`` (full recomputation of the preset blocks), ``"selective"``, ``"offload"``
    (those modes on the preset blocks), ``"every_n"`` (every n-th of L sibling preset blocks,
    n = √L rounded), a dotted class path, or a module-name glob. A mapping holds :class:`Policy`
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
        return (Policy(None if modules == "preset" else modules, spec.get("every_n"), spec.get("mode", "full")),)
    if isinstance(spec, Sequence):
        if not spec:
            raise ValueError("`policy` is an empty list; give at least one policy")
        return tuple(policy for item in spec for policy in parse_policy(item))
    raise TypeError(
        f"`policy`={spec!r} must be a Policy, a string, a module class, a mapping of {', '.join(POLICY_KEYS)}, "
        "or a list of those"
    )


def resolve_class(path: str) -> type[nn.Module]:
    """Import the ``nn.Module`` subclass at a dotted ``path``.

    Raises:
        ValueError: the module imports but has no such ``nn.Module`` subclass.
        ModuleNotFoundError: the module part does not import.

    Example::

        >>> resolve_class("torch.nn.Linear")
        <class 'torch.nn.modules.linear.Linear'>
    """
    module_path, _, attribute = path.rpartition(".")
    found = getattr(importlib.import_module(module_path), attribute, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"`modules` entry {path!r}: {module_path!r} has no nn.Module subclass {attribute!r}")
    return found


def describe_model(model: nn.Module) -> str:
    """The module classes and top-level child names of ``model``, for an error message."""
    classes = sorted({type(module).__name__ for module in model.modules()})
    children = [name for name, _ in model.named_children()]
    return f"module classes present: {', '.join(classes)}; top-level children: {', '.join(children) or '(none)'}"


def _normalise_modules(modules: ModuleSpec | Iterable[ModuleSpec] | None) -> tuple[ModuleSpec, ...] | None:
    if modules is None or modules == "preset":
        return None
    items = [modules] if isinstance(modules, str | type) else list(modules)
    if not items:
        raise ValueError("`modules` is empty; give module classes or name globs, or None for the preset blocks")
    return tuple(_resolve_spec(item) for item in items)


def _resolve_spec(spec: Any) -> ModuleSpec:
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise ValueError(f"`modules` entry {spec!r} is not an nn.Module subclass")
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`modules` entry {spec!r} must be a module class, a dotted class path or a name glob")
    if "." in spec and "*" not in spec:
        try:
            return resolve_class(spec)
        except ModuleNotFoundError:
            pass  # not an importable path: a module-name glob such as "updateformer.time_blocks"
    return spec


def _spec_name(spec: ModuleSpec) -> str:
    return spec if isinstance(spec, str) else spec.__name__


def _glob_matches_end(pattern: list[str], segments: list[str]) -> bool:
    """Whether ``pattern`` (glob segments, ``**`` for any number) matches the last segments of a name."""
    if not pattern:
        return True
    head, rest = pattern[-1], pattern[:-1]
    if head == "**":
        return any(_glob_matches_end(rest, segments[:cut]) for cut in range(len(segments) + 1))
    # the pattern's earlier segments must match the segments right before this one
    return bool(segments) and fnmatch.fnmatchcase(segments[-1], head) and _glob_matches_end(rest, segments[:-1])


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
