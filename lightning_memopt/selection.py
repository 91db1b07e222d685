"""Select submodules of a model by class or by name glob.

Shared by the surgeries that act on chosen modules: activation checkpointing and fp32 islands.
A spec is a module class, an importable dotted class path, or a glob on module names that
matches the end of a name segment by segment (``*`` stays within one segment, ``**`` spans
several), so ``"fnet"`` finds ``model.fnet`` and ``"updateformer.time_blocks.*"`` each time block.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable, Sequence

from torch import nn

ModuleSpec = str | type[nn.Module]
# components that wrappers (FSDP, torch's checkpoint wrapper, torch.compile) insert into module names
WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_WRAPPER_CLASSES = ("CheckpointWrapper", "FullyShardedDataParallel")


def normalise_specs(specs: ModuleSpec | Iterable[ModuleSpec], argument: str = "modules") -> tuple[ModuleSpec, ...]:
    """Resolve dotted class paths to classes and check every entry; ``argument`` names it in errors.

    Raises:
        ValueError: an empty list, a value that is no list of specs (``True``, ``3``), or an entry that
            is neither a module class, an importable dotted class path nor a name glob.

    Example::

        >>> normalise_specs(["torch.nn.Linear", "head.*"])
        (<class 'torch.nn.modules.linear.Linear'>, 'head.*')
    """
    if not isinstance(specs, str | type | Iterable):
        raise ValueError(
            f"`{argument}` must be module classes, dotted class paths or name globs, got {specs!r} "
            f"({type(specs).__name__})"
        )
    items = [specs] if isinstance(specs, str | type) else list(specs)
    if not items:
        raise ValueError(f"`{argument}` is empty; give module classes, dotted class paths or name globs")
    return tuple(_resolve_spec(item, argument) for item in items)


def select_modules(model: nn.Module, specs: Sequence[ModuleSpec]) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs of ``model`` that any of ``specs`` selects, in module order.

    The root module (empty name) and the wrappers FSDP and torch's checkpoint wrapper insert are
    never selected; wrapper segments are skipped in names, so globs match wrapped models too.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> [name for name, _ in select_modules(model, [nn.Linear])]
        ['0', '2']
    """
    classes = tuple(spec for spec in specs if isinstance(spec, type))
    globs = [spec.split(".") for spec in specs if isinstance(spec, str)]
    found = []
    for name, module in model.named_modules():
        segments = [part for part in name.split(".") if part and part not in WRAPPER_NAMES]
        if not segments or type(module).__name__ in _WRAPPER_CLASSES:
            continue
        if isinstance(module, classes) or any(_glob_matches_end(pattern, segments) for pattern in globs):
            found.append((name, module))
    return found


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


def spec_name(spec: ModuleSpec) -> str:
    """A spec as written: the glob, or the class name."""
    return spec if isinstance(spec, str) else spec.__name__


def describe_model(model: nn.Module) -> str:
    """The module classes and top-level child names of ``model``, for an error message."""
    classes = sorted({type(module).__name__ for module in model.modules()})
    children = [name for name, _ in model.named_children()]
    return f"module classes present: {', '.join(classes)}; top-level children: {', '.join(children) or '(none)'}"


def _resolve_spec(spec: object, argument: str) -> ModuleSpec:
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise ValueError(f"`{argument}` entry {spec!r} is not an nn.Module subclass")
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`{argument}` entry {spec!r} must be a module class, a dotted class path or a name glob")
    if "." in spec and "*" not in spec:
        try:
            return resolve_class(spec)
        except ModuleNotFoundError:
            pass  # not an importable path: a module-name glob such as "updateformer.time_blocks"
    return spec


def _glob_matches_end(pattern: list[str], segments: list[str]) -> bool:
    """Whether ``pattern`` (glob segments, ``**`` for any number) matches the last segments of a name."""
    if not pattern:
        return True
    head, rest = pattern[-1], pattern[:-1]
    if head == "**":
        return any(_glob_matches_end(rest, segments[:cut]) for cut in range(len(segments) + 1))
    # the pattern's earlier segments must match the segments right before this one
    return bool(segments) and fnmatch.fnmatchcase(segments[-1], head) and _glob_matches_end(rest, segments[:-1])
