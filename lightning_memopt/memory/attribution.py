"""ModuleAttribution: which module, and which tracked block, is running while a tensor is made."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.records import storages
from lightning_memopt.private_api import tree_flatten


class ModuleAttribution:
    """Forward hooks that keep the stack of running modules, so a tracker can say who made each storage.

    Top-level children (:meth:`track_children`) name a storage's module; tracked blocks
    (:meth:`track_blocks`, the innermost running one) name its block, count their calls and
    remember the storages of their latest outputs.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> attribution = ModuleAttribution()
        >>> attribution.track_blocks(model, ["1"])
        >>> _ = model(torch.zeros(1, 2))
        >>> attribution.calls, attribution.current_block
        ({'1': 1}, '')
        >>> attribution.remove_hooks()
    """

    def __init__(self) -> None:
        self._module_stack: list[str] = []
        self._block_stack: list[str] = []
        self.outputs: dict[str, set[int]] = {}  # block -> storage keys of its latest outputs
        self.calls: dict[str, int] = {}  # block -> forward calls
        self.hooks: list[Any] = []  # every handle added here or by the tracker: removed together

    def track_children(self, module: nn.Module) -> None:
        """Name the storages made inside each top-level child of ``module`` after that child; a ``ModuleList`` or
        ``ModuleDict`` child is never called itself, so its members carry its name."""
        for name, child in module.named_children():
            members = child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
            for member in members:
                self.hooks.append(member.register_forward_pre_hook(self._enter_module(name)))
                self.hooks.append(member.register_forward_hook(self._leave_module))

    def track_blocks(self, model: nn.Module, names: Iterable[str]) -> None:
        """Attribute new storages to the named submodules of ``model`` (the innermost one that is running)."""
        modules = dict(model.named_modules())
        for name in names:
            module = modules[name]
            self.hooks.append(module.register_forward_pre_hook(self._enter_block(name)))
            self.hooks.append(module.register_forward_hook(self._leave_block(name)))

    @property
    def current_module(self) -> str:
        """The top-level child running now, or ``""``."""
        return self._module_stack[0] if self._module_stack else ""

    @property
    def current_block(self) -> str:
        """The innermost tracked block running now, or ``""``."""
        return self._block_stack[-1] if self._block_stack else ""

    def remove_hooks(self) -> None:
        """Detach every hook."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def _enter_module(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._module_stack.append(name)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def _enter_block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._block_stack.append(name)
            self.calls[name] = self.calls.get(name, 0) + 1

        return hook

    def _leave_block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._block_stack:
                self._block_stack.pop()
            outputs = (t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
            self.outputs[name] = {id(storage) for t in outputs for storage, _ in storages(t)}

        return hook
