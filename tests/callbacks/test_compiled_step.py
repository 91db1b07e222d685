"""CompiledStep compiles the module for the fit at its activation budget and undoes both after; MemoryBudget with
compile=True weighs it against its eager plan; memopt-train's compile=true reaches one or the other."""

import logging

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryBudget
from lightning_memopt.callbacks import CompiledStep
from lightning_memopt.cli.train import compile_callbacks
from lightning_memopt.memory.compiled import compiled_parts
from lightning_memopt.private_api import graph_break_reasons
from tests.checkpointing.test_under_compile import ShiftingBlock, _Blocks
from tests.helpers import quiet_trainer


class _SeesTheBudget(CompiledStep):
    """Records the partitioner's budget and whether the module runs compiled, in the middle of the fit."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen = (torch._functorch.config.activation_memory_budget, compiled_parts(pl_module))


def test_the_module_runs_compiled_at_the_budget_during_the_fit_and_as_it_came_after():
    torch._dynamo.reset()
    module = _Blocks(ShiftingBlock)
    before = torch._functorch.config.activation_memory_budget
    callback = _SeesTheBudget(0.4)
    breaks = set(graph_break_reasons())
    quiet_trainer(max_steps=2, callbacks=[callback]).fit(module)
    assert callback.seen == (0.4, ["_Blocks (Module.compile())"])
    assert [reason for reason in graph_break_reasons() if reason not in breaks] == []
    assert torch._functorch.config.activation_memory_budget == before
    assert compiled_parts(module) == []


def test_a_module_compiled_already_is_left_as_it_is_with_a_warning():
    module = _Blocks(ShiftingBlock)
    module.compile(backend="aot_eager")
    with pytest.warns(UserWarning, match=r"CompiledStep: the module runs compiled code already \(_Blocks"):
        quiet_trainer(max_steps=1, callbacks=[CompiledStep(0.5)]).fit(module)
    assert compiled_parts(module) == ["_Blocks (Module.compile())"]  # the user's compile stays


def test_a_budget_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"`budget` must be a number ≥ 0\.0 and ≤ 1\.0, got 2"):
        CompiledStep(2)
    with pytest.raises(MisconfigurationException, match=r"MemoryBudget: `compile` must be"):
        MemoryBudget(compile="sometimes")


def test_memory_budget_weighs_compiling_and_says_which_won(caplog):
    torch._dynamo.reset()
    module = _Blocks(ShiftingBlock)
    budget = MemoryBudget(budget=0.5, compile=True)
    with caplog.at_level(logging.INFO):
        quiet_trainer(max_steps=3, callbacks=[budget]).fit(module)
    verdict = next(record.getMessage() for record in caplog.records if " over 3 steps: eager (" in record.getMessage())
    compiled = budget.knobs.compile_budget is not None
    assert verdict.startswith(f"MemoryBudget: {'compiled' if compiled else 'eager'} over 3 steps")
    assert any(isinstance(callback, CompiledStep) for callback in budget.applied) == compiled


def test_compile_true_tells_memory_budget_or_adds_a_compiled_step():
    budget = MemoryBudget()
    assert compile_callbacks(True, [budget]) == [] and budget.compile
    added = compile_callbacks(True, [])
    assert len(added) == 1 and isinstance(added[0], CompiledStep) and added[0].budget == 1.0
    assert compile_callbacks(False, []) == []
