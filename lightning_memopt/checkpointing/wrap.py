"""apply / remove activation checkpointing on any model, without editing it.

A module is checkpointed by giving it an instance ``forward`` that runs the class's forward as traced graphs that
recompute in backward (or under host offloading; where no trace can follow it, recomputed eagerly or under
non-reentrant ``torch.utils.checkpoint``). Nothing is replaced:
module names, ``state_dict`` keys, ``isinstance`` checks, parameters and hooks stay as they were,
so checkpoints load either way and DDP or FSDP may wrap the model before or after.
"""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memopt.checkpointing.offload import offload_to_host
from lightning_memopt.checkpointing.policy import KEYWORDS, ActivationBudget, Policy, PolicySpec, parse_policy
from lightning_memopt.checkpointing.recompute import reaches_one_input, recompute_in_backward
from lightning_memopt.checkpointing.recompute_state import RecomputeState, cuda_devices
from lightning_memopt.checkpointing.selective import selective_context
from lightning_memopt.checkpointing.traced_graph import TracedGraph
from lightning_memopt.checkpointing.under_compile import hold_side_effects, release_side_effects
from lightning_memopt.memory.autocast_lists import under_lists_of_forward
from lightning_memopt.private_api import is_batch_norm
from lightning_memopt.selection import describe_model
from lightning_memopt.vocabulary import LEAN

log = logging.getLogger(__name__)


@dataclass
class CheckpointReport:
    """What a model has checkpointed after a :func:`checkpoint_modules` call: names and classes per mode."""

    modules: dict[str, str] = field(default_factory=dict)  # module name -> mode
    classes: dict[str, Counter[str]] = field(default_factory=dict)  # mode -> class name -> count

    @property
    def count(self) -> int:
        return len(self.modules)

    def describe(self) -> str:
        """``"wrapped 30 modules: full 30 (IBasicBlock ×30)"``."""
        parts = [
            f"{mode} {sum(counts.values())} ({', '.join(f'{name} ×{n}' for name, n in counts.most_common())})"
            for mode, counts in self.classes.items()
        ]
        return f"wrapped {self.count} modules: " + "; ".join(parts)


class CheckpointedForward:
    """The instance ``forward`` of a checkpointed module: the class's forward, recomputed or offloaded.

    In ``"lean"`` mode a module with a ``checkpointed_forward`` method (a memory-lean recomputation
    that keeps nothing but its inputs for backward; see :mod:`lightning_memopt.models.structure`) is
    run by that method — except while compiling, when another instance forward was there before
    ours, or when it holds batch norms that track running statistics; otherwise ``"lean"`` is ``"full"``.
    """

    def __init__(self, module: nn.Module, mode: str, previous: Callable[..., Any] | None) -> None:
        self.module = module
        self.mode = mode
        self.previous = previous  # an instance forward that was there before ours, kept and restored
        self.state = RecomputeState(module)  # norm statistics and random draws, kept between calls
        self.graph = TracedGraph(module)  # full and selective recomputation by traced graphs, where they can be
        hold_side_effects(self)  # under torch.compile, a forward that sets an attribute traces (see under_compile)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a deep copy of a checkpointed model holds it too
        self.__dict__.update(state)
        hold_side_effects(self)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "offload":
            with offload_to_host():
                return self._forward(*args, **kwargs)
        if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
            return self._forward(*args, **kwargs)
        compiling = torch.compiler.is_compiling()  # then the compiler plans the recomputation, never calling Python
        if self.mode == LEAN and not compiling:
            lean = self._lean_forward()
            if lean is not None:
                return lean(*args, **kwargs)
        # a profile planning for CUDA on the CPU: the recomputation follows the autocast lists the forward did
        forward = under_lists_of_forward(self._forward)
        if not compiling and self.previous is None:
            traced = "selective" if self.mode == "selective" else "full"  # lean without a lean path is full
            output = self.graph.run(forward, args, kwargs, traced)
            if output is not None:
                return output
        if not compiling and reaches_one_input(args, kwargs):
            selective = self.mode == "selective" and self.state.selective.pays is not False
            return recompute_in_backward(self.state, forward, args, kwargs, selective=selective)
        options: dict[str, Any] = {"use_reentrant": False}
        options["preserve_rng_state"] = self.state.draws.known(self.module.training) is not False
        if self.mode == "selective":
            options["context_fn"] = selective_context
        function = forward if compiling else _FirstRunThenScratch(self.state, forward)
        return checkpoint(function, *args, **options, **kwargs)

    def _lean_forward(self) -> Callable[..., Any] | None:
        """The module's ``checkpointed_forward``, where it may stand in for ``checkpoint``."""
        lean = getattr(self.module, "checkpointed_forward", None)
        if not callable(lean) or self.previous is not None:
            return None
        # it would update their running statistics again on recomputing: recompute_in_backward pauses tracking
        tracked = (is_batch_norm(m) and m.training and m.track_running_stats for m in self.module.modules())
        return None if any(tracked) else lean


def checkpoint_modules(model: nn.Module, policy: PolicySpec) -> CheckpointReport:
    """Checkpoint the modules of ``model`` that ``policy`` selects; see :func:`apply_activation_checkpointing`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module, got {model!r} ({type(model).__name__})")
    policies = parse_policy(policy)
    if isinstance(policies[0], ActivationBudget):
        raise ValueError(
            f"a {policies[0].describe()} policy is chosen from a measured training step: use the "
            "ActivationCheckpointing callback (it profiles the first training batch), or "
            "lightning_memopt.planner.plan_checkpointing(model, batch, budget) and apply its policy()"
        )
    already = _checkpointed(model)
    claimed: dict[str, tuple[nn.Module, str]] = {}
    for rule in policies:
        matches = rule.matches(model)
        if not matches:
            raise ValueError(f"Checkpointing policy {rule.describe()} matches no module; {_nothing_found(rule, model)}")
        taken = 0
        for name, module in matches:  # parents come before their children: the outermost match is kept
            if name in claimed or _overlaps(name, claimed) or (name not in already and _overlaps(name, already)):
                continue
            claimed[name] = (module, rule.mode)
            taken += 1
        if not taken:
            log.warning(
                "Checkpointing policy %s matched %d modules, all inside or around modules an earlier policy took",
                rule.describe(),
                len(matches),
            )
    for module, mode in claimed.values():
        _wrap(module, mode)
    report = CheckpointReport()
    for name, forward in _checkpointed(model).items():
        report.modules[name] = forward.mode
        report.classes.setdefault(forward.mode, Counter())[type(forward.module).__name__] += 1
    return report


def apply_activation_checkpointing(model: nn.Module, policy: PolicySpec = "auto") -> int:
    """Checkpoint the modules of ``model`` that ``policy`` selects; return how many are checkpointed.

    Applying again is idempotent (a module already wrapped the same way is left as it is, one
    wrapped differently takes the new mode). A module inside or around one that is already
    checkpointed is not wrapped again: checkpoints never nest.

    Args:
        model: any ``nn.Module`` (a LightningModule included).
        policy: anything :func:`~lightning_memopt.checkpointing.policy.parse_policy` accepts:
            ``"auto"`` (the model's declared, else discovered, blocks; ``"preset"`` is the same),
            ``"selective"``, ``"offload"``, ``"every_n"``, module classes or dotted paths, name
            globs, ``{"modules": ..., "every_n": ..., "mode": ...}``, or a list of those.

    Returns:
        The number of modules of ``model`` checkpointed by this call or an earlier one.

    Raises:
        ValueError: a policy that matches no module (listing the classes and top-level children
            present), or a malformed policy.
        TypeError: ``model`` is no ``nn.Module``, or ``policy`` of no kind listed above.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> model = create_model("iresnet_tiny")
        >>> apply_activation_checkpointing(model, "preset"), apply_activation_checkpointing(model, "preset")
        (4, 4)
        >>> remove_activation_checkpointing(model)
        4
    """
    report = checkpoint_modules(model, policy)
    log.info("Activation checkpointing %s", report.describe())
    return report.count


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Restore the original forward of every checkpointed module in ``model``; return how many.

    Example::

        >>> remove_activation_checkpointing(nn.Linear(2, 2))
        0
    """
    checkpointed = _checkpointed(model).values()
    for forward in checkpointed:
        del forward.module.forward  # the instance attribute: back to the class's forward
        if forward.previous is not None:
            forward.module.forward = forward.previous
        release_side_effects(forward)
    return len(checkpointed)


def checkpoint_mode(module: nn.Module) -> str | None:
    """The mode ``module`` is checkpointed with, or None."""
    forward = module.__dict__.get("forward")
    return forward.mode if isinstance(forward, CheckpointedForward) else None


def _checkpointed(model: nn.Module) -> dict[str, CheckpointedForward]:
    """The patched forwards of ``model``'s checkpointed modules, by module name."""
    found = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    return {name: forward for name, forward in found.items() if isinstance(forward, CheckpointedForward)}


def _wrap(module: nn.Module, mode: str) -> None:
    current = module.__dict__.get("forward")
    if isinstance(current, CheckpointedForward):
        current.mode = mode
    else:
        module.forward = CheckpointedForward(module, mode, current)


def _nothing_found(rule: Policy, model: nn.Module) -> str:
    if rule.modules is not None:
        words = [m for m in rule.modules if isinstance(m, str) and "." not in m and "*" not in m]
        near = [found for word in words for found in difflib.get_close_matches(word, list(KEYWORDS), n=1)]
        keyword = f"did you mean the policy {near[0]!r}? " if near else ""
        return f"{keyword}{describe_model(model)}; policy names: {', '.join(KEYWORDS)}"
    children = ", ".join(f"{name} ({type(child).__name__})" for name, child in model.named_children()) or "(none)"
    return (
        "no module declares its blocks (a `memory_structure()` method) and no repeated blocks were found (two or "
        f"more sibling modules of one class, with parameters); top-level children: {children}. Name the modules "
        "to checkpoint instead: a module class, a dotted class path or a name glob such as 'encoder.layers.*'"
    )


def _overlaps(name: str, names: dict[str, Any]) -> bool:
    """Whether ``name`` lies inside or around one of ``names`` (the root "" surrounds all)."""
    for other in names:
        if other == name:
            continue
        if not other or not name or name.startswith(other + ".") or other.startswith(name + "."):
            return True
    return False


class _FirstRunThenScratch:
    """The block's forward under ``torch.utils.checkpoint``: the first run learns whether the block draws random
    numbers; the recomputation updates scratch batch-norm statistics, so running statistics move once per step.
    Scratch buffers are swapped in by attribute assignment, so the recomputation issues exactly the ops of the
    first run (selective checkpointing replays them one for one)."""

    def __init__(self, state: RecomputeState, forward: Callable[..., Any]) -> None:
        self.state = state
        self.forward = forward
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1:
            with self.state.norm_stats.swapped_in():
                return self.forward(*args, **kwargs)
        training = self.state.module.training
        if self.state.draws.known(training) is None:
            devices = cuda_devices(self.state.module, (args, kwargs))
            return self.state.draws.observe(training, lambda: self.forward(*args, **kwargs), devices)
        return self.forward(*args, **kwargs)
