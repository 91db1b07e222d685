"""Selective recomputation where it pays: a block whose kept ops save less than its per-op replay costs the host is
recomputed in full after its first calls; one of large matmuls keeps them; gradients stay bitwise the plain step's.

The verdict is for blocks that go the dispatch-mode way (a traced block keeps its ops with no per-op Python): these
blocks get a hook on a module inside, which no trace would run."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memopt.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_memopt.checkpointing import selective_payoff as payoff
from lightning_memopt.checkpointing.selective import KeepExpensive
from lightning_memopt.checkpointing.selective_payoff import TIMED_CALLS, SelectivePayoff
from tests.helpers import keep_expensive_counted


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _selective(width: int, blocks: int = 2) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    plain = nn.Sequential(*(Mlp(width) for _ in range(blocks)))
    wrapped = _by_dispatch_mode(copy.deepcopy(plain))
    apply_activation_checkpointing(wrapped, {"modules": [str(i) for i in range(blocks)], "mode": "selective"})
    return plain, wrapped


def _by_dispatch_mode(model: nn.Sequential) -> nn.Sequential:
    for block in model:
        block.up.register_forward_hook(lambda module, args, output: None)
    return model


def _verdicts(model: nn.Sequential) -> list[bool | None]:
    return [block.forward.state.selective.pays for block in model]


def test_tiny_blocks_fall_back_to_full_after_their_timed_calls_with_the_plain_steps_gradients(monkeypatch, caplog):
    plain, wrapped = _selective(width=8)
    made = keep_expensive_counted(monkeypatch)
    monkeypatch.setattr(payoff, "_logged", set())
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger=payoff.__name__):
        for step in range(TIMED_CALLS + 2):
            for model in (plain, wrapped):
                model.zero_grad()
                model(x).square().sum().backward()
            for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad), step
            assert _verdicts(wrapped) == ([None, None] if step < TIMED_CALLS - 1 else [False, False]), step
    assert len(made) == 2 * TIMED_CALLS and all(keep.timed for keep in made)  # then no mode at all
    named = [record.getMessage() for record in caplog.records if "recomputed in full" in record.getMessage()]
    assert len(named) == 1 and named[0].startswith("selective checkpointing: Mlp is recomputed in full")


def test_blocks_of_large_matmuls_keep_them():
    plain, wrapped = _selective(width=384, blocks=1)
    x = torch.randn(256, 384)
    for _ in range(TIMED_CALLS + 1):
        for model in (plain, wrapped):
            model.zero_grad()
            model(x).square().sum().backward()
        assert torch.equal(plain[0].up.weight.grad, wrapped[0].up.weight.grad)
    assert _verdicts(wrapped) == [True]


@pytest.mark.parametrize(("seconds_per_op", "pays"), [(0.0, True), (1.0, False)])
def test_the_verdict_weighs_the_kept_ops_time_against_the_ops_times_the_modes_cost(monkeypatch, seconds_per_op, pays):
    monkeypatch.setattr(payoff, "mode_seconds_per_op", lambda: seconds_per_op)
    verdict = SelectivePayoff()
    for call in range(TIMED_CALLS):
        kept = KeepExpensive(timed=True)
        with kept:
            torch.randn(4, 4) @ torch.randn(4, 4)
        assert kept.ops == 3 and len(kept.outputs) == 1 and kept.kept_seconds() > 0  # two randn, one mm
        verdict.decide(kept, nn.Linear)
        assert verdict.pays is (pays if call == TIMED_CALLS - 1 else None)


def test_fake_tensors_time_nothing_and_keep_the_mode_as_asked():
    _, wrapped = _selective(width=8)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        x = fake.from_tensor(torch.randn(4, 8))
        for _ in range(TIMED_CALLS + 1):
            wrapped(x).sum().backward()
    assert _verdicts(wrapped) == [None, None]


@pytest.mark.cuda
def test_cuda_blocks_are_timed_on_the_device():
    for width, pays in ((8, False), (2048, True)):
        _, wrapped = _selective(width=width, blocks=1)
        wrapped.cuda()
        x = torch.randn(4096 if pays else 4, width, device="cuda")
        for _ in range(TIMED_CALLS):
            wrapped(x).square().sum().backward()
        assert _verdicts(wrapped) == [pays], width


def test_the_verdict_outlives_removing_and_applying_the_checkpointing_again(monkeypatch):
    _, wrapped = _selective(width=8, blocks=1)
    x = torch.randn(4, 8)
    for _ in range(TIMED_CALLS):
        wrapped(x).sum().backward()
    remove_activation_checkpointing(wrapped)
    apply_activation_checkpointing(wrapped, {"modules": ["0"], "mode": "selective"})
    made = keep_expensive_counted(monkeypatch)
    wrapped(x).sum().backward()
    assert _verdicts(wrapped) == [False] and not made


class InPlace(nn.Module):
    """Changes its matmul's output in place: what the first run kept is no longer what the op made."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu_(self.up(x)))


def test_a_block_that_changes_a_kept_output_in_place_saved_nothing_and_is_recomputed_in_full(monkeypatch):
    monkeypatch.setattr(payoff, "mode_seconds_per_op", lambda: 0.0)  # keeping would pay, were anything kept
    torch.manual_seed(0)
    plain = nn.Sequential(InPlace(384))
    wrapped = _by_dispatch_mode(copy.deepcopy(plain))
    apply_activation_checkpointing(wrapped, {"modules": ["0"], "mode": "selective"})
    x = torch.randn(64, 384)
    for _ in range(TIMED_CALLS):
        for model in (plain, wrapped):
            model.zero_grad()
            model(x).square().sum().backward()
        assert torch.equal(plain[0].up.weight.grad, wrapped[0].up.weight.grad)
    assert _verdicts(wrapped) == [False]


def test_a_copy_of_a_decided_model_decides_afresh():
    _, wrapped = _selective(width=8)
    for _ in range(TIMED_CALLS):
        wrapped(torch.randn(4, 8)).sum().backward()
    assert _verdicts(wrapped) == [False, False]
    assert _verdicts(copy.deepcopy(wrapped)) == [None, None]
