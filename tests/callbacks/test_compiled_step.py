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
from tests.checkpointing.test_under_compile import ShiftingBlock, _Blocks
from tests.helpers import quiet_trainer


class _SeesTheBudget(CompiledStep):
    """Records the partitioner's budget and whether the module runs compiled, in the middle of the fit."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen = (torch._functorch.config.activation_memory_budget, compiled_parts(pl_module))


class _CallsItsNetwork(_Blocks):
    """A training step that calls its network, not ``self(...)`` (as the project's tasks do)."""

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()


def test_the_training_step_runs_compiled_at_the_budget_during_the_fit_and_as_it_came_after():
    torch._dynamo.reset()
    module = _CallsItsNetwork(ShiftingBlock)
    before = torch._functorch.config.activation_memory_budget
    callback = _SeesTheBudget(0.4)
    quiet_trainer(max_steps=2, callbacks=[callback]).fit(module)
    assert callback.seen == (0.4, ["_CallsItsNetwork.training_step (torch.compile)"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the network's ops ran in a compiled graph
    assert torch._functorch.config.activation_memory_budget == before
    assert compiled_parts(module) == [] and "training_step" not in module.__dict__


def test_a_failed_fit_gives_the_setting_and_the_module_back():
    class Fails(_Blocks):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("the step failed")

    module, before = Fails(ShiftingBlock), torch._functorch.config.activation_memory_budget
    with pytest.raises(RuntimeError, match="the step failed"):
        quiet_trainer(max_steps=1, callbacks=[CompiledStep(0.3)]).fit(module)
    assert torch._functorch.config.activation_memory_budget == before and compiled_parts(module) == []


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
    given = MemoryBudget(knobs={"precision": "32-true", "checkpoint": "full"})
    assert compile_callbacks(True, [given]) == [] and given.knobs.compile_budget == 1.0  # memopt=planned
    added = compile_callbacks(True, [])
    assert len(added) == 1 and isinstance(added[0], CompiledStep) and added[0].budget == 1.0
    assert compile_callbacks(False, []) == []
