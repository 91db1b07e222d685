"""Which parts of a module run ``torch.compile``d code: a tensor-accounting dispatch mode must not run them.

A ``TorchDispatchMode`` (the :class:`~lightning_memopt.memory.MemoryTracker`) active when dynamo first meets a
frame turns compilation off for that frame for the rest of the process, so the callbacks that track a step
ask this first; and a compiled method is bound to its module, so a copy to profile or try is made uncompiled.
"""

from __future__ import annotations

import copy
from typing import Any

import torch  # noqa: F401  (the example compiles)
from torch import nn

from lightning_memopt.private_api import function_compiled, module_compiled, optimized_module_class, uncompile_module

# the methods `trainer.fit(torch.compile(module))` compiles on the module (Lightning's `from_compiled`)
COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def compiled_parts(module: nn.Module) -> list[str]:
    """The parts of ``module`` that run ``torch.compile``d code, named for a message; empty if none.

    Found: compiled submodules (``torch.compile(submodule)``, ``submodule.compile()``), and a compiled
    ``forward`` or step method (decorated, assigned, or ``trainer.fit(torch.compile(model))``, which
    Lightning turns into those). A compiled function that the module calls from elsewhere is not found.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> compiled_parts(net)
        []
        >>> net[0] = torch.compile(net[0])
        >>> compiled_parts(net)
        ["0 (torch.compile'd module)"]
    """
    found: list[str] = []
    inside_compiled: list[str] = []
    optimized_module = optimized_module_class()
    for name, submodule in module.named_modules():
        if any(name.startswith(prefix) for prefix in inside_compiled):
            continue  # the module a compiled wrapper holds runs compiled too: named once
        label = name or type(submodule).__name__
        if optimized_module is not None and isinstance(submodule, optimized_module):
            found.append(f"{label} (torch.compile'd module)")
            inside_compiled.append(f"{name}." if name else "")
            continue
        if module_compiled(submodule):
            found.append(f"{label} (Module.compile())")
            continue
        for method in COMPILED_METHODS:
            if function_compiled(getattr(submodule, method, None)):
                found.append(f"{label}.{method} (torch.compile)")
    return found


def uncompiled_copy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of ``module`` (``memo`` as ``copy.deepcopy`` takes it) that runs its own code eagerly.

    A compiled ``forward`` or step method (``trainer.fit(torch.compile(model))``) or ``Module.compile()`` is a
    function bound to ``module`` itself, which a deep copy shares: the copy would train the original's weights. The
    copy gets its class's methods (or the original function, bound to the copy) instead; a ``torch.compile``'d
    submodule stays compiled (its wrapper holds the copied module).

    Example::

        >>> net = nn.Linear(2, 2)
        >>> net.compile()
        >>> twin = uncompiled_copy(net)
        >>> compiled_parts(net), compiled_parts(twin)
        (['Linear (Module.compile())'], [])
    """
    twin = copy.deepcopy(module, memo)
    for submodule in twin.modules():
        if module_compiled(submodule):
            uncompile_module(submodule)
        for method in COMPILED_METHODS:
            compiled = submodule.__dict__.get(method)
            if not function_compiled(compiled):
                continue
            original = compiled._torchdynamo_orig_callable
            function = getattr(original, "__func__", None)
            if function is None:
                submodule.__dict__[method] = original
            elif function is getattr(type(submodule), method, None):
                del submodule.__dict__[method]
            else:
                submodule.__dict__[method] = function.__get__(submodule)
    return twin
