"""recompute_in_backward: the block run without autograd and again in backward, exact as the plain step."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.checkpointing.recompute import reaches_one_input, recompute_in_backward
from lightning_memopt.checkpointing.recompute_state import NormStatistics, RandomDraws, RecomputeState
from lightning_memopt.checkpointing.selective import KeepExpensive
from lightning_memopt.checkpointing.wrap import CheckpointedForward


class Mixed(nn.Module):
    """Keyword arguments, a non-tensor argument, a tuple and a dict out, dropout and batch norm inside."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, scale=1.0, mask=None):
        y = self.drop(self.norm(self.linear(x))) * scale
        if mask is not None:
            y = y * mask
        return y.relu(), {"sum": y.sum(1), "count": torch.tensor(3)}


def _grads(model, policy, x, **kwargs):
    torch.manual_seed(0)
    if policy is not None:
        apply_activation_checkpointing(model, {"modules": ["block"], "mode": policy})
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    first, extra = model.block(x, **kwargs)
    (first.square().sum() + extra["sum"].sum()).backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()], first.detach(), model.state_dict()


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_nested_outputs_keywords_dropout_and_batch_norm_are_bitwise_the_plain_step(policy):
    x, mask = torch.randn(5, 6), (torch.rand(5, 6) > 0.3).float()
    reference, checkpointed = nn.Module(), nn.Module()
    reference.block, checkpointed.block = Mixed(), Mixed()
    checkpointed.load_state_dict(reference.state_dict())
    plain = _grads(reference, None, x, scale=2.0, mask=mask)
    for _ in range(2):  # the first call learns the block draws random numbers; the second relies on it
        wrapped = _grads(checkpointed, policy, x, scale=2.0, mask=mask)
        checkpointed.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain[0], wrapped[0], strict=True))
    assert torch.equal(plain[1], wrapped[1])
    # the running statistics moved once per step: two steps here against one there
    assert int(wrapped[2]["block.norm.num_batches_tracked"]) == 2 * int(plain[2]["block.norm.num_batches_tracked"])


def test_a_block_without_inputs_requiring_gradients_still_trains_its_parameters():
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)  # raw data: no gradient wanted
    expected = torch.autograd.grad(block(x).sum(), list(block.parameters()))
    recompute_in_backward(RecomputeState(block), block.forward, (x,)).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(block.parameters(), expected, strict=True))


def test_autocast_of_the_forward_is_restored_in_the_recomputation():
    block = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = recompute_in_backward(RecomputeState(block), block.forward, (x,))
        expected = torch.autograd.grad(block(x).float().sum(), x)[0]
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # outside autocast: the recomputation must run in bf16 as the forward did
    assert torch.equal(x.grad, expected)


def test_random_draws_are_found_on_the_first_call_of_each_mode():
    dropout = nn.Dropout(0.5)
    draws = RandomDraws()
    draws.observe(True, lambda: dropout.train()(torch.ones(8)), [])
    draws.observe(False, lambda: dropout.eval()(torch.ones(8)), [])
    assert draws.known(True) is True and draws.known(False) is False


def test_scratch_statistics_are_made_once_and_survive_pickling():
    norm = nn.BatchNorm1d(3)
    scratch = NormStatistics(norm)
    with scratch.swapped_in():
        first = norm.running_mean
        norm(torch.randn(4, 3))
    with scratch.swapped_in():
        assert norm.running_mean is first  # kept between calls, not cloned anew
    assert torch.equal(norm.running_mean, torch.zeros(3)) and int(norm.num_batches_tracked) == 0
    copied = pickle.loads(pickle.dumps(scratch))
    assert copied.module is not norm and isinstance(copied.module, nn.BatchNorm1d)
    assert copy.deepcopy(scratch).tracked()


def test_only_blocks_of_one_input_taking_gradients_take_the_fast_path():
    x = torch.randn(2, requires_grad=True)
    assert reaches_one_input((x, 3, torch.ones(2)), {})
    assert not reaches_one_input(([x, x * 2],), {})
    assert not reaches_one_input((x,), {"other": x + 1})


def test_two_inputs_taking_gradients_fall_back_to_torch_checkpoint_and_stay_exact():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, a, b):
            return self.linear(a) * b

    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    block = Pair()
    expected = torch.autograd.grad((block(a, b) + a).sum(), (a, b))
    block.forward = CheckpointedForward(block, "full", None)
    got = torch.autograd.grad((block(a, b) + a).sum(), (a, b))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_selective_recomputes_only_the_cheap_ops_and_gives_up_on_an_output_changed_in_place():
    weight = torch.randn(8, 8)
    x = torch.randn(4, 8)
    keep = KeepExpensive()
    with keep:
        product = x @ weight
        product.relu_()  # the matmul's kept output is no longer what the matmul made
    assert not keep.intact()
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x.requires_grad_()
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    state = RecomputeState(block)
    got = torch.autograd.grad(recompute_in_backward(state, block.forward, (x,), selective=True).sum(), x)[0]
    assert torch.equal(expected, got)


def test_attention_kept_from_a_first_run_without_autograd_has_the_logsumexp_its_backward_reads():
    # CUDA's memory-efficient attention leaves the logsumexp out when autograd is off (a block's first run): an H100
    # then refused the selective backward ("LSE is not correctly aligned (strideH)"); meta tensors keep its shapes
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.randn(1, 2, 40, 16, device="meta")
    keep = KeepExpensive()
    with torch.no_grad(), keep:
        op(q, q, q, None, torch.is_grad_enabled())
    with torch.enable_grad(), keep.replay():
        replayed = op(q, q, q, None, True)
    assert replayed[1].shape == (1, 2, 64)  # 40 rows padded to 64, as the backward reads it


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
        return x + self.out(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


@pytest.mark.cuda
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_cuda_attention_blocks_give_the_gradients_of_the_plain_step(policy, precision):
    torch.manual_seed(0)
    reference = nn.Sequential(Attention(), Attention()).cuda()
    checkpointed = copy.deepcopy(reference)
    apply_activation_checkpointing(checkpointed, {"modules": ["0", "1"], "mode": policy})
    x = torch.randn(2, 40, 64, device="cuda")
    grads = []
    for model in (reference, checkpointed):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
            model(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_a_replay_that_meets_another_op_runs_the_rest_for_real_and_says_which():
    keep = KeepExpensive()
    with keep:
        torch.ones(2, 2) @ torch.ones(2, 2)
    replay = keep.replay()
    with replay:
        out = torch.nn.functional.conv2d(torch.ones(1, 1, 3, 3), torch.full((1, 1, 1, 1), 2.0))
        after = torch.ones(2, 2) @ torch.full((2, 2), 3.0)  # run too, not taken from the first run
    assert torch.equal(out, torch.full((1, 1, 3, 3), 2.0)) and torch.equal(after, torch.full((2, 2), 6.0))
    assert replay.diverged == (torch.ops.aten.mm.default, torch.ops.aten.convolution.default)


class GradModeAttention(nn.Module):
    """Attention whose kernel follows autograd, as CPU SDPA's does with a mask (transformers' Swin): the first run
    (autograd off) and the recomputation (autograd on) issue different ops."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        if torch.is_grad_enabled():
            return x + torch.bmm(h, h.transpose(1, 2)).softmax(-1) @ h
        weights = (h.unsqueeze(2) * h.unsqueeze(1)).sum(-1).softmax(-1)  # the same products, by no matmul
        return x + (weights.unsqueeze(-1) * h.unsqueeze(1)).sum(2)


def test_a_selective_block_whose_kernels_follow_autograd_trains_as_full_recomputation(monkeypatch, caplog):
    from lightning_memopt.checkpointing.traced_graph import TracedGraph

    monkeypatch.setattr(TracedGraph, "run", lambda self, *args, **kwargs: None)  # the way of a block no trace follows
    torch.manual_seed(0)
    model = nn.Sequential(GradModeAttention(), GradModeAttention())
    full, selective = copy.deepcopy(model), copy.deepcopy(model)
    apply_activation_checkpointing(full, {"modules": ["0", "1"], "mode": "full"})
    apply_activation_checkpointing(selective, {"modules": ["0", "1"], "mode": "selective"})
    x = torch.randn(2, 4, 8)
    grads = []
    with caplog.at_level("INFO", logger="lightning_memopt.checkpointing.selective_payoff"):
        for wrapped in (full, selective, selective):  # the second selective step recomputes in full from the start
            wrapped(x).square().mean().backward()
            grads.append([p.grad.clone() for p in wrapped.parameters()])
            wrapped.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2], strict=True))
    assert "GradModeAttention is recomputed in full: its recomputation (autograd on) ran aten.bmm" in caplog.text


def test_the_recomputed_forward_backs_through_once_only():
    block = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = recompute_in_backward(RecomputeState(block), block.forward, (x,))
    with pytest.raises(RuntimeError, match=r"Linear is checkpointed: its backward cannot be differentiated"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_full_recomputation_runs_the_block_forward_again_and_updates_no_statistics(monkeypatch, traced):
    """The recomputation's extra kernels are the block's forward kernels less the statistics update: batch norms
    recompute with tracking paused (scratch statistics would launch that update again), and the running statistics
    move once per step. Traced, backward recomputes only what it needs (not the last ReLU, whose output is kept)."""
    from lightning_memopt.checkpointing.traced_graph import TracedGraph
    from lightning_memopt.memory.work import KernelCounter

    if not traced:  # the way of a block no trace follows
        monkeypatch.setattr(TracedGraph, "run", lambda self, *args, **kwargs: None)

    def step(wrapped: bool) -> tuple[int, int, nn.BatchNorm1d]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()))
        if wrapped:
            apply_activation_checkpointing(model, {"modules": ["1"], "mode": "full"})
        x = torch.randn(8, 4)
        with torch.no_grad(), KernelCounter() as block_forward:
            model[1](model[0](x))
        model[1][1].reset_running_stats()
        with KernelCounter() as counter:
            model(x).sum().backward()
        return counter.kernels, block_forward.kernels - 1, model[1][1]  # less the first Linear's addmm

    plain, block_forward, plain_norm = step(False)
    wrapped, _, wrapped_norm = step(True)
    update = 1  # num_batches_tracked.add_ (the CPU kernel updates the running mean and variance in place)
    if traced:
        assert 0 < wrapped - plain < block_forward - update
    else:
        assert wrapped - plain == block_forward - update
    assert torch.equal(wrapped_norm.running_mean, plain_norm.running_mean)
    assert int(wrapped_norm.num_batches_tracked) == int(plain_norm.num_batches_tracked) == 1
