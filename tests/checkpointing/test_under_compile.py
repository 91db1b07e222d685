"""Checkpointed blocks under torch.compile: a forward that sets an attribute traces into one graph; what still
breaks the graph at the blocks is said once, naming them; planning a compiled model neither trains it nor leaves it
uncompiled."""

import copy
import gc
import warnings
import weakref

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_memopt import ActivationCheckpointing, MemoryBudget
from lightning_memopt.checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    under_compile,
)
from lightning_memopt.memory.compiled import compiled_parts, uncompiled_copy
from lightning_memopt.private_api import compiled_checkpoint_side_effects, graph_break_reasons, is_fake
from tests.helpers import quiet_trainer


class ShiftingBlock(nn.Module):
    """Sets a plain attribute from its input's size on every call, as transformers' Swin layers do."""

    def __init__(self, width: int = 8, window: int = 4) -> None:
        super().__init__()
        self.window = window
        self.shift = 2
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] <= self.window:
            self.shift = 0
        return torch.roll(self.linear(x).relu(), self.shift, dims=1) + x


class BreakingBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.linear(x).tanh() + x


@pytest.fixture(autouse=True)
def no_other_checkpointed_blocks(monkeypatch):
    """Only this test's blocks hold dynamo's setting (other tests' models may live on), and torch's default first."""
    monkeypatch.setattr(under_compile._SideEffectsHold, "holders", weakref.WeakSet())
    monkeypatch.setattr(under_compile._SideEffectsHold, "held", False)
    before = compiled_checkpoint_side_effects(False)
    yield
    compiled_checkpoint_side_effects(before)


def _stack(block, count: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(block() for _ in range(count)))


def _gradients(model: nn.Module, runner=None, steps: int = 2) -> list[torch.Tensor]:
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        (runner or model)(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


def _new_breaks(before: set[str]) -> list[str]:
    return [reason for reason in graph_break_reasons() if reason not in before]


def test_a_block_setting_an_attribute_traces_checkpointed_into_one_graph_with_the_plain_gradients():
    torch._dynamo.reset()
    plain = _stack(ShiftingBlock)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, [ShiftingBlock])
    expected = _gradients(plain, torch.compile(plain, backend="aot_eager"))
    before = set(graph_break_reasons())
    got = _gradients(checkpointed, torch.compile(checkpointed, backend="aot_eager"))
    assert _new_breaks(before) == []
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert [block.shift for block in checkpointed] == [0, 0, 0]  # the forward's change happened, once
    remove_activation_checkpointing(checkpointed)


def test_under_torchs_default_the_same_model_breaks_its_graph_at_every_block():
    """What the setting changes: refused side effects break the graph at the checkpoint (the test above can fail)."""
    torch._dynamo.reset()
    model = _stack(ShiftingBlock)
    apply_activation_checkpointing(model, [ShiftingBlock])
    compiled_checkpoint_side_effects(False)
    try:
        before = set(graph_break_reasons())
        _gradients(model, torch.compile(model, backend="aot_eager"), steps=1)
        assert any("shift" in reason for reason in _new_breaks(before))
    finally:
        compiled_checkpoint_side_effects(True)
        remove_activation_checkpointing(model)
    assert compiled_checkpoint_side_effects() is False  # no block checkpointed: torch's default again


def test_a_deep_copy_of_a_checkpointed_model_keeps_the_setting_after_the_original_is_freed():
    model = _stack(ShiftingBlock)
    apply_activation_checkpointing(model, [ShiftingBlock])
    twin = copy.deepcopy(model)
    remove_activation_checkpointing(model)
    assert compiled_checkpoint_side_effects() is True
    remove_activation_checkpointing(twin)
    assert compiled_checkpoint_side_effects() is False


def test_a_checkpointed_model_deleted_without_unwrapping_gives_the_setting_back():
    """As a planner trial drops its checkpointed copy: the setting comes back when the last block is collected, and the
    next checkpointing remembers torch's own value, not ours."""
    model = _stack(ShiftingBlock)
    apply_activation_checkpointing(model, [ShiftingBlock])
    del model
    gc.collect()
    assert compiled_checkpoint_side_effects() is False
    again = _stack(ShiftingBlock)
    apply_activation_checkpointing(again, [ShiftingBlock])
    remove_activation_checkpointing(again)
    assert compiled_checkpoint_side_effects() is False


class _Blocks(LightningModule):
    def __init__(self, block) -> None:
        super().__init__()
        self.net = _stack(block)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=2)


def _fit_warnings(module, callback, steps: int = 3) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=steps, callbacks=[callback]).fit(module)
    return [str(w.message) for w in caught if "torch.compile broke its graph" in str(w.message)]


def test_a_graph_break_at_the_checkpointed_blocks_is_said_once_with_the_blocks_the_limit_and_the_fix():
    torch._dynamo.reset()
    module = _Blocks(BreakingBlock)
    with torch._dynamo.config.patch(recompile_limit=2):
        said = _fit_warnings(torch.compile(module, backend="aot_eager"), ActivationCheckpointing([BreakingBlock]))
    assert len(said) == 1
    assert "checkpointed blocks (BreakingBlock ×3)" in said[0]
    assert "recompile limit (2)" in said[0] and "Fix: " in said[0]


def test_a_clean_compile_says_nothing():
    torch._dynamo.reset()
    module = _Blocks(ShiftingBlock)
    assert _fit_warnings(torch.compile(module, backend="aot_eager"), ActivationCheckpointing([ShiftingBlock])) == []


class _CountingBackend:
    """A compile backend that runs the graph as traced and counts its calls on real tensors."""

    def __init__(self) -> None:
        self.real_calls = 0
        self.compiled = 0

    def __call__(self, graph, example_inputs):
        self.compiled += 1

        def run(*args):
            self.real_calls += not any(is_fake(arg) for arg in args if isinstance(arg, torch.Tensor))
            return graph(*args)

        return run


def _compiled(style: str, module: _Blocks, backend):
    if style == "trainer.fit(torch.compile(module))":
        return torch.compile(module, backend=backend)
    if style == "module.compile()":
        module.compile(backend=backend)
    else:
        module.net = torch.compile(module.net, backend=backend)
    return module


@pytest.mark.parametrize("style", ["trainer.fit(torch.compile(module))", "module.compile()", "a compiled submodule"])
def test_memory_budget_plans_a_compiled_model_and_the_run_stays_compiled(style):
    """Planning profiles an uncompiled copy: a compiled method bound to the module would have run the fake step on
    the real weights (it failed), and compiled code first met under the tracker would stay uncompiled."""
    torch._dynamo.reset()
    module, backend = _Blocks(ShiftingBlock), _CountingBackend()
    fitted = _compiled(style, module, backend)
    start = [p.detach().clone() for p in module.parameters()]
    quiet_trainer(max_steps=2, callbacks=[MemoryBudget(budget=0.5)]).fit(fitted)
    assert backend.real_calls >= 2  # both training steps ran compiled
    assert backend.compiled == 1  # once, for the run: planning ran everything eagerly
    assert compiled_parts(module)
    assert any(not torch.equal(a, p) for a, p in zip(start, module.parameters(), strict=True))


def test_an_uncompiled_copy_trains_its_own_weights():
    module = _Blocks(ShiftingBlock)
    module.training_step = torch.compile(module.training_step, backend="aot_eager")
    twin = uncompiled_copy(module)
    start = [p.detach().clone() for p in module.parameters()]
    twin.training_step((torch.randn(2, 4, 8),), 0).backward()
    assert all(p.grad is None for p in module.parameters())
    assert all(p.grad is not None for p in twin.parameters())
    assert all(torch.equal(a, p) for a, p in zip(start, module.parameters(), strict=True))
    assert compiled_parts(twin) == []
