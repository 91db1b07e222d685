import pytest
import torch
from torch import nn

from lightning_memopt.accumulation import BatchSplitError, MicroBatchRunner, SampleOutOfMemoryError, halve
from lightning_memopt.memory import MemoryTracker, SimulatedDevice


def injected_oom():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


class FailInBackward(torch.autograd.Function):
    """Identity forward; the backward raises out-of-memory for more than ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            raise injected_oom()
        return grad, None


class Net(nn.Module):
    """Linear → tanh → [backward fails past ``backward_limit``] → Linear; forward fails past ``forward_limit``."""

    def __init__(self, forward_limit=None, backward_limit=None):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(6, 12), nn.Linear(12, 3)
        self.forward_limit, self.backward_limit = forward_limit, backward_limit
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.forward_limit is not None and x.shape[0] > self.forward_limit:
            raise injected_oom()
        hidden = torch.tanh(self.first(x))
        if self.backward_limit is not None:
            hidden = FailInBackward.apply(hidden, self.backward_limit)
        return self.second(hidden)


def loss_fn(model, reduction="mean"):
    def step(batch):
        x, y = batch
        errors = (model(x) - y).pow(2).sum(dim=1)
        return errors.mean() if reduction == "mean" else errors.sum()

    return step


def reference_gradients(batch, reduction="mean"):
    model = Net()
    loss_fn(model, reduction)(batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_close(gradients, expected):
    """Equal within 1e-6 of each tensor's norm: fp32 sums taken in another order, nothing more."""
    for got, want in zip(gradients, expected, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-6


BATCH = (torch.randn(13, 6, generator=torch.Generator().manual_seed(1)), torch.randn(13, 3))


@pytest.mark.parametrize("size", [1, 3, 4, 13, 40])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_give_the_whole_batch_gradient(size, reduction):
    model = Net()
    result = MicroBatchRunner(model, loss_reduction=reduction).run(
        loss_fn(model, reduction), BATCH, size, backward=torch.Tensor.backward
    )
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH, reduction))
    assert sum(result.sizes) == 13 and max(result.sizes) == min(size, 13)
    whole = loss_fn(Net(), reduction)(BATCH)
    torch.testing.assert_close(result.loss, whole.detach())
    assert not result.oom_errors


def test_forward_oom_redoes_only_the_failed_piece():
    model = Net(forward_limit=3)
    result = MicroBatchRunner(model).run(loss_fn(model), BATCH, None, backward=torch.Tensor.backward)
    # 13 fails, its first 7 fail, their first 4 fail: 2 + 2, then the rest of the 7, then the rest in pairs
    assert result.sizes == [2, 2, 2, 1, 2, 2, 2]
    assert result.micro_batch_size == 2
    assert len(result.oom_errors) == 3 and "injected" in result.oom_errors[0]
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))


def test_backward_oom_after_some_gradients_counts_every_sample_once():
    # the second layer's gradient is written before the backward fails in front of the first layer
    model = Net(backward_limit=4)
    result = MicroBatchRunner(model).run(loss_fn(model), BATCH, 8, backward=torch.Tensor.backward)
    assert result.micro_batch_size == 4 and result.sizes == [4, 4, 4, 1]
    assert len(result.oom_errors) == 1
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))


def test_without_coverage_the_partial_gradient_would_be_counted_twice():
    # the same failure, with the second layer's gradient inspected after the failing backward
    model = Net(backward_limit=4)
    x, y = BATCH
    with pytest.raises(torch.OutOfMemoryError):
        loss_fn(model)((x[:8], y[:8])).backward()
    assert model.first.weight.grad is None and model.second.weight.grad is not None


def test_repeated_failures_shrink_by_the_given_function():
    model = Net(forward_limit=2)
    sizes_tried = []

    def shrink(size):
        sizes_tried.append(size)
        return size - 3 if size > 3 else 1

    result = MicroBatchRunner(model, shrink=shrink).run(loss_fn(model), BATCH, 8, backward=torch.Tensor.backward)
    assert sizes_tried[0] == 8 and result.micro_batch_size <= 2
    assert sum(result.sizes) == 13
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))


def test_bad_shrink_result_is_an_error():
    model = Net(forward_limit=2)
    with pytest.raises(ValueError, match=r"`shrink`\(8\) returned 8; it must return an int in \[1, 7\]"):
        MicroBatchRunner(model, shrink=lambda size: size).run(loss_fn(model), BATCH, 8, backward=torch.Tensor.backward)


def test_one_sample_that_does_not_fit():
    model = Net(forward_limit=0)
    with pytest.raises(SampleOutOfMemoryError, match="a micro-batch of one sample does not fit") as info:
        MicroBatchRunner(model).run(loss_fn(model), BATCH, 2, backward=torch.Tensor.backward)
    x, _ = info.value.sample
    assert torch.equal(x, BATCH[0][:1])
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_other_errors_pass_through():
    def step(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        MicroBatchRunner(Net()).run(step, BATCH, 4, backward=torch.Tensor.backward)


def test_buffers_are_restored_when_a_micro_batch_fails():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += x.shape[0]  # updated before the failure, like batch-norm statistics
            if x.shape[0] > 2:
                raise injected_oom()
            return self.layer(x)

    model = Counting()
    MicroBatchRunner(model).run(lambda x: model(x).sum(), torch.ones(5, 2), None, backward=torch.Tensor.backward)
    assert model.seen.item() == 5


class DropoutNet(Net):
    """Net with dropout after the first layer, so each sample's draws come from the generator's stream."""

    def forward(self, x):
        self.calls += 1
        hidden = nn.functional.dropout(torch.tanh(self.first(x)), 0.5)
        if self.forward_limit is not None and x.shape[0] > self.forward_limit:
            raise injected_oom()  # after the dropout drew its mask: the failed attempt advanced the generator
        if self.backward_limit is not None:
            hidden = FailInBackward.apply(hidden, self.backward_limit)
        return self.second(hidden)


@pytest.mark.parametrize("limits", [{"forward_limit": 4}, {"backward_limit": 4}])
def test_a_redone_piece_draws_what_the_whole_batch_would_have(limits):
    # on the CPU the generator is sequential, so 8 samples redone as 4 + 4 draw the 8 samples' masks
    whole = DropoutNet()
    torch.manual_seed(5)
    loss_fn(whole)(BATCH).backward()
    model = DropoutNet(**limits)
    torch.manual_seed(5)
    result = MicroBatchRunner(model).run(loss_fn(model), BATCH, None, backward=torch.Tensor.backward)
    assert len(result.oom_errors) >= 1
    assert_close([p.grad for p in model.parameters()], [p.grad for p in whole.parameters()])


def test_without_the_generators_put_back_a_redone_piece_draws_other_masks(monkeypatch):
    monkeypatch.setattr("lightning_memopt.accumulation.runner.restore_random_state", lambda state: None)
    whole = DropoutNet()
    torch.manual_seed(5)
    loss_fn(whole)(BATCH).backward()
    model = DropoutNet(forward_limit=4)
    torch.manual_seed(5)
    MicroBatchRunner(model).run(loss_fn(model), BATCH, None, backward=torch.Tensor.backward)
    difference = (model.first.weight.grad - whole.first.weight.grad).norm() / whole.first.weight.grad.norm()
    assert difference > 1e-2


def test_every_sample_counted_once_under_a_simulated_device():
    embedding = nn.Embedding(32, 1)
    nn.init.zeros_(embedding.weight)
    ids = torch.arange(32)
    wide = nn.Linear(1, 4096)

    def step(batch):
        return wide(embedding(batch)).sum(dim=1).mean()

    tracker = MemoryTracker()
    with tracker:
        step(ids[:8]).backward()
    budget = tracker.peak.total_bytes  # room for 8 samples, not for 32
    embedding.weight.grad = wide.weight.grad = wide.bias.grad = None
    module = nn.ModuleDict({"embedding": embedding, "wide": wide})
    with SimulatedDevice(budget + sum(p.numel() * 8 for p in module.parameters()), include=[module]):
        result = MicroBatchRunner(module).run(step, ids, None, backward=torch.Tensor.backward)
    assert result.oom_errors and result.micro_batch_size <= 8
    # each id's gradient is d/dx of mean over 32 samples: every id once, none twice
    expected = wide.weight.sum().detach() / 32
    torch.testing.assert_close(embedding.weight.grad.squeeze(1), expected.expand(32), rtol=1e-6, atol=1e-8)


def test_agreement_across_ranks():
    calls = []

    def other_rank_is_smaller_and_slower(values):
        calls.append(list(values))
        negative_size, failed, unfinished, oom, min_size = values
        return [max(negative_size, -2), failed, 1 if len(calls) < 8 else unfinished, oom, min_size]  # other: size 2

    model = Net()
    result = MicroBatchRunner(model, agree=other_rank_is_smaller_and_slower).run(
        loss_fn(model), BATCH, 5, backward=torch.Tensor.backward
    )
    assert result.sizes == [5, 2, 2, 2, 2] and result.micro_batch_size == 2 and not result.recovered
    assert len(calls) == 8  # kept agreeing while the other rank had samples left
    assert calls[-1][2] == 0
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))


def test_failure_on_another_rank_stops_this_one():
    model = Net()
    with pytest.raises(SampleOutOfMemoryError, match="another rank") as info:
        MicroBatchRunner(model, agree=lambda values: [values[0], 1, 0, 1, 1]).run(
            loss_fn(model), BATCH, 4, backward=torch.Tensor.backward
        )
    assert info.value.sample is None


def test_forward_only_concatenates_outputs():
    model = Net(forward_limit=4)
    with torch.no_grad():
        result = MicroBatchRunner(model).run(lambda batch: {"pred": model(batch[0])}, BATCH, None)
        whole = Net()(BATCH[0])
    assert result.loss is None and result.micro_batch_size == 4
    torch.testing.assert_close(result.output["pred"], whole)


def test_unknown_loss_reduction():
    with pytest.raises(ValueError, match="Unknown `loss_reduction`='max'; valid choices: mean, sum"):
        MicroBatchRunner(Net(), loss_reduction="max")


def test_halve_rounds_up():
    assert [halve(n) for n in (2, 3, 8, 9)] == [1, 2, 4, 5]


def test_an_oom_on_another_rank_counts_as_a_recovery_here():
    model = Net()
    result = MicroBatchRunner(model, agree=lambda values: [-2, 0, 0, 1, 1]).run(
        loss_fn(model), BATCH, None, backward=torch.Tensor.backward
    )
    assert result.recovered and not result.oom_errors and result.micro_batch_size == 2


def test_a_batch_it_cannot_split_runs_whole_and_fails_with_both_reasons():
    model = Net()
    batch = (*BATCH, object())
    result = MicroBatchRunner(model).run(lambda b: loss_fn(model)(b[:2]), batch, None, backward=torch.Tensor.backward)
    assert result.sizes == [1]  # one indivisible piece
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))
    failing = Net(forward_limit=4)
    with pytest.raises(SampleOutOfMemoryError, match="cannot be split into micro-batches: cannot split batch") as info:
        MicroBatchRunner(failing).run(lambda b: loss_fn(failing)(b[:2]), batch, None, backward=torch.Tensor.backward)
    assert info.value.sample is batch
    with pytest.raises(BatchSplitError, match="type object"):
        MicroBatchRunner(model).run(lambda b: loss_fn(model)(b[:2]), batch, 4, backward=torch.Tensor.backward)


def test_an_empty_batch():
    with pytest.raises(ValueError, match="`batch` has no samples"):
        MicroBatchRunner(Net()).run(loss_fn(Net()), (torch.zeros(0, 6), torch.zeros(0, 3)), None)


def test_a_reassigned_buffer_is_restored_by_name():
    class Reassigning(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)
            self.register_buffer("ema", torch.zeros(()))

        def forward(self, x):
            self.ema = self.ema * 0.5 + x.shape[0]  # a new tensor, not an in-place update
            if x.shape[0] > 2:
                raise injected_oom()
            return self.layer(x)

    model = Reassigning()
    MicroBatchRunner(model).run(lambda x: model(x).sum(), torch.ones(4, 2), None, backward=torch.Tensor.backward)
    assert model.ema.item() == pytest.approx((0 * 0.5 + 2) * 0.5 + 2)  # the two pieces of 2, not the failed 4


def test_in_lockstep_an_error_is_raised_as_it_is_and_nothing_is_retried():
    model = Net(backward_limit=2)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        MicroBatchRunner(model, lockstep=True).run(loss_fn(model), BATCH, 4, backward=torch.Tensor.backward)
    assert model.calls == 1  # no smaller piece: the other ranks are still in that piece's collectives


def test_in_lockstep_every_rank_runs_as_many_micro_batches():
    agreed = []

    def other_rank_cuts_one_piece(values):
        agreed.append(list(values))
        return [max(value, other) for value, other in zip(values, [1, -1], strict=True)]

    model = Net()
    runner = MicroBatchRunner(model, agree=other_rank_cuts_one_piece, lockstep=True)
    with pytest.raises(ValueError, match=r"make 1 to 4 \(here a batch of 13 samples in micro-batches of 4 makes 4\)"):
        runner.run(loss_fn(model), BATCH, 4, backward=torch.Tensor.backward)
    assert agreed == [[4, -4]] and model.calls == 0  # checked before the first piece
