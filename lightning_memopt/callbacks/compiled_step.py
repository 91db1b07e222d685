"""CompiledStep: run a LightningModule ``torch.compile``d at an activation memory budget for the fit, then undo it."""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_float
from lightning_memopt.memory.compiled import compiled_parts
from lightning_memopt.private_api import activation_memory_budget


class CompiledStep(Callback):
    """Compile the module's ``training_step`` in ``setup`` of a fit, at an activation memory budget.

    Lightning calls ``training_step`` itself, so that is what runs compiled (with whatever it calls: ``self(x)``,
    ``self.network(x)``). Compilation is lazy: the first training step compiles, with the budget set for the whole
    fit. In ``teardown`` (or when the fit fails) the module runs uncompiled again and the setting is as it was. A
    module that runs compiled code already is left as it is, with a warning (its compile is the user's).
    ``MemoryBudget`` applies it for knobs with a ``compile_budget``.

    Args:
        budget: the fraction in [0, 1] of what the min-cut partitioner could save that it saves
            (``activation_memory_budget``; 1.0, the default, is torch's; 0.0 recomputes all it can).

    Example::

        >>> CompiledStep(0.6).budget
        0.6
    """

    def __init__(self, budget: float = 1.0) -> None:
        self.budget = check_float("budget", budget, minimum=0.0, maximum=1.0)
        self._setting: contextlib.ExitStack | None = None
        self._compiled_here = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        already = compiled_parts(pl_module)
        if already:
            rank_zero_warn(
                f"CompiledStep: the module runs compiled code already ({', '.join(already)}): left as it is, compiled "
                f"with its own settings, at activation_memory_budget {self.budget:g}"
            )
        else:
            pl_module.training_step = torch.compile(pl_module.training_step)  # an instance attribute, deleted after
            self._compiled_here = True
        self._setting = contextlib.ExitStack()
        self._setting.enter_context(activation_memory_budget(self.budget))
        rank_zero_info(f"CompiledStep: torch.compile at activation_memory_budget {self.budget:g}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._undo(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._undo(pl_module)  # Lightning skips teardown after an error: the next fit in this process starts clean

    def _undo(self, pl_module: LightningModule) -> None:
        if self._setting is not None:
            self._setting.close()
            self._setting = None
        if self._compiled_here:
            del pl_module.training_step
            self._compiled_here = False
