"""The smallest micro-batch a model takes: never cut below it, a clear error when it does not fit, learnt."""

import copy

import pytest
import torch
from torch import nn

from lightning_memopt.accumulation import (
    MicroBatchRunner,
    MicroBatchSizeError,
    SampleOutOfMemoryError,
    min_micro_batch_size,
)
from lightning_memopt.accumulation.sizing import MicroBatchSizer
from tests.accumulation.test_micro_batch_runner import BATCH, Net, assert_close, injected_oom, loss_fn

BN_REASON = "its BatchNorm1d layers need at least 2 samples in training"


class NormNet(nn.Module):
    """Linear → BatchNorm1d → tanh → Linear; the forward runs out of memory past ``limit`` samples."""

    def __init__(self, limit=None):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.norm, self.second = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3)
        self.limit = limit

    def forward(self, x):
        if self.limit is not None and x.shape[0] > self.limit:
            raise injected_oom()
        return self.second(torch.tanh(self.norm(self.first(x))))


class RejectsOne(Net):
    """No batch norm, but a forward that refuses one sample (a limit inspection does not see); it counts samples."""

    def __init__(self, forward_limit=None):
        super().__init__(forward_limit)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]  # updated before the failures, like batch-norm statistics
        if x.shape[0] == 1:
            raise ValueError("Expected more than 1 value per channel when training")
        return super().forward(x)


def batch_of(samples, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=generator), torch.randn(samples, 3, generator=generator)


def by_hand(model, batch, sizes):
    """The pieces ``sizes`` run one after the other on ``model``, each loss weighted by its share."""
    x, y = batch
    position = 0
    for size in sizes:
        loss = loss_fn(model)((x[position : position + size], y[position : position + size]))
        (loss * (size / len(x))).backward()
        position += size
    return [p.grad for p in model.parameters()]


def test_the_smallest_micro_batch_of_a_module():
    norm = NormNet()
    assert min_micro_batch_size(norm) == (2, BN_REASON)
    assert min_micro_batch_size(norm.eval()) == (1, None)  # running statistics: one sample is fine
    assert min_micro_batch_size(Net()) == (1, None)
    assert min_micro_batch_size(nn.BatchNorm1d(4, track_running_stats=False).eval())[0] == 2  # batch statistics
    two_kinds = nn.Sequential(nn.BatchNorm2d(3), nn.Flatten(), nn.BatchNorm1d(3))
    reason = "its BatchNorm1d, BatchNorm2d layers need at least 2 samples in training"
    assert min_micro_batch_size(two_kinds) == (2, reason)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_bad_min_size_is_a_clear_error(bad):
    message = rf"`min_size`={bad!r} must be an int ≥ 1 \(1: any size; 2: batch norm in training\)"
    with pytest.raises(ValueError, match=message):
        MicroBatchRunner(Net(), min_size=bad)
    runner = MicroBatchRunner(Net())
    with pytest.raises(ValueError, match=message):
        runner.min_size = bad
    with pytest.raises(ValueError, match=message):
        MicroBatchSizer(min_size=bad)


@pytest.mark.parametrize(
    ("total", "size", "least", "expected"),
    [
        (17, 8, 1, [8, 8, 1]),
        (17, 8, 2, [8, 7, 2]),  # the remainder of 1 takes one sample from the piece before it
        (10, 4, 3, [4, 3, 3]),
        (9, 4, 3, [4, 5]),  # too few for two pieces of 3 after the 4: one piece of 5
        (13, 1, 2, [2, 2, 2, 2, 2, 3]),  # a size below the minimum is raised to it
        (3, 8, 2, [3]),
        (1, 8, 2, [1]),  # a batch smaller than the minimum runs whole
    ],
)
def test_no_piece_is_cut_below_the_minimum(total, size, least, expected):
    model = Net()
    batch = batch_of(total)
    result = MicroBatchRunner(model, min_size=least).run(loss_fn(model), batch, size, backward=torch.Tensor.backward)
    assert result.sizes == expected
    reference = Net()
    loss_fn(reference)(batch).backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_a_batch_norm_model_in_training_runs_a_remainder_of_one_in_pieces_of_two():
    model, twin = NormNet(), NormNet()
    batch = batch_of(17)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # what the runner avoids
        loss_fn(copy.deepcopy(model))((batch[0][16:], batch[1][16:])).backward()
    least, reason = min_micro_batch_size(model)
    result = MicroBatchRunner(model, min_size=least, min_size_reason=reason).run(
        loss_fn(model), batch, 8, backward=torch.Tensor.backward
    )
    assert result.sizes == [8, 7, 2]
    torch.testing.assert_close([p.grad for p in model.parameters()], by_hand(twin, batch, [8, 7, 2]), rtol=0, atol=0)
    torch.testing.assert_close(model.norm.running_mean, twin.norm.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(model.norm.running_var, twin.norm.running_var, rtol=0, atol=0)


def test_with_batch_norm_in_eval_mode_the_pieces_give_the_whole_batch_gradient():
    model, reference = NormNet().eval(), NormNet().eval()
    batch = batch_of(17)
    result = MicroBatchRunner(model, min_size=2).run(loss_fn(model), batch, 8, backward=torch.Tensor.backward)
    loss_fn(reference)(batch).backward()
    assert result.sizes == [8, 7, 2]
    torch.testing.assert_close(
        [p.grad for p in model.parameters()], [p.grad for p in reference.parameters()], rtol=1e-6, atol=1e-7
    )


def test_out_of_memory_above_two_samples_completes_in_pieces_of_two():
    model, twin = NormNet(limit=2), NormNet()
    batch = batch_of(18)
    result = MicroBatchRunner(model, min_size=2).run(loss_fn(model), batch, None, backward=torch.Tensor.backward)
    # 18 → 10 → 6 → 4 → 2: halves rounded up to a multiple of the minimum, so no piece of 3 (or 1) is left
    assert result.sizes == [2] * 9 and result.micro_batch_size == 2
    assert len(result.oom_errors) == 4
    torch.testing.assert_close([p.grad for p in model.parameters()], by_hand(twin, batch, [2] * 9), rtol=0, atol=0)
    torch.testing.assert_close(model.norm.running_mean, twin.norm.running_mean, rtol=0, atol=0)


def test_when_two_samples_do_not_fit_the_error_says_so():
    model = NormNet(limit=1)
    with pytest.raises(SampleOutOfMemoryError) as info:
        MicroBatchRunner(model, min_size=2, min_size_reason=BN_REASON).run(
            loss_fn(model), batch_of(16), None, backward=torch.Tensor.backward
        )
    message = str(info.value)
    assert f"a micro-batch of 2 samples, the smallest the model takes ({BN_REASON}), does not fit" in message
    assert "injected" in message
    x, _ = info.value.sample
    assert info.value.size == 2 and torch.equal(x, batch_of(16)[0][:2])
    assert isinstance(info.value, torch.OutOfMemoryError) and not isinstance(info.value, ValueError)


def test_an_odd_piece_that_cannot_be_cut_into_pieces_of_two():
    model = NormNet(limit=2)
    with pytest.raises(
        SampleOutOfMemoryError,
        match="a micro-batch of 3 samples does not fit, and it cannot be cut into micro-batches of at least 2 samples",
    ) as info:
        MicroBatchRunner(model, min_size=2).run(loss_fn(model), batch_of(3), None, backward=torch.Tensor.backward)
    assert info.value.size == 3


def test_an_error_on_one_sample_while_redoing_after_out_of_memory_teaches_the_minimum():
    model = RejectsOne(forward_limit=1)  # 2 samples run out of memory, 1 sample raises
    runner = MicroBatchRunner(model)
    with pytest.raises(SampleOutOfMemoryError) as info:
        runner.run(loss_fn(model), BATCH, 4, backward=torch.Tensor.backward)
    message = str(info.value)
    assert (
        "a micro-batch of 2 samples, the smallest the model takes (a micro-batch of 1 sample raised ValueError: "
        "Expected more than 1 value per channel when training), does not fit (OutOfMemoryError: " in message
    )
    assert isinstance(info.value.__cause__, ValueError) and info.value.size == 2
    assert runner.min_size == runner.learned_min_size == 2
    assert model.seen.item() == 0  # every piece failed, and each put the buffers back


def test_an_error_on_a_remainder_teaches_the_minimum_for_later_batches():
    model = RejectsOne()
    runner = MicroBatchRunner(model)
    batch = batch_of(17)
    with pytest.raises(MicroBatchSizeError) as info:
        runner.run(loss_fn(model), batch, 8, backward=torch.Tensor.backward)
    assert str(info.value) == (
        "AdaptiveAccumulation: a micro-batch of 1 sample raised ValueError: Expected more than 1 value per channel "
        "when training, after larger micro-batches ran: the model takes no fewer than 2 samples. This batch cannot be "
        "completed (its earlier micro-batches are accumulated already); later batches are cut into micro-batches of "
        "at least 2 samples"
    )
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)
    assert (info.value.size, info.value.min_size) == (1, 2)
    assert runner.min_size == runner.learned_min_size == 2
    assert model.seen.item() == 16  # the failed sample's update was put back
    model.zero_grad(set_to_none=True)
    result = runner.run(loss_fn(model), batch, 8, backward=torch.Tensor.backward)
    assert result.sizes == [8, 7, 2]
    reference = Net()
    loss_fn(reference)(batch).backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_errors_that_are_not_about_the_size_pass_through():
    class FailsOnSecondPiece(Net):
        def forward(self, x):
            if (x[:, 0] == BATCH[0][4, 0]).any():
                raise ValueError("a bad sample")
            return super().forward(x)

    runner = MicroBatchRunner(FailsOnSecondPiece())
    # a piece of 4 after one of 4 ran: the size works, the error is the step's
    with pytest.raises(ValueError, match="a bad sample") as info:
        runner.run(loss_fn(runner.module), BATCH, 4, backward=torch.Tensor.backward)
    assert not isinstance(info.value, MicroBatchSizeError) and runner.min_size == 1 and runner.learned_min_size is None
    with pytest.raises(ValueError, match="a bad sample"):  # the whole batch
        runner.run(loss_fn(runner.module), BATCH, None, backward=torch.Tensor.backward)
    assert runner.min_size == 1


def test_a_size_error_on_another_rank_stops_this_one_and_teaches_its_minimum():
    model = Net()
    runner = MicroBatchRunner(model, agree=lambda values: [values[0], 2, 1, 0, 3])
    with pytest.raises(MicroBatchSizeError, match="another rank .* at least 3 samples") as info:
        runner.run(loss_fn(model), BATCH, 4, backward=torch.Tensor.backward)
    assert info.value.size is None and runner.min_size == runner.learned_min_size == 3


def test_the_minimum_travels_in_the_agreement():
    calls = []

    def agree(values):
        calls.append(list(values))
        return values

    model = NormNet()
    MicroBatchRunner(model, agree=agree, min_size=2).run(loss_fn(model), batch_of(6), 4, backward=torch.Tensor.backward)
    assert [call[4] for call in calls] == [2, 2] and [call[1] for call in calls] == [0, 0]


def test_the_sizer_never_goes_below_the_minimum():
    sizer = MicroBatchSizer(size=1, min_size=2, thrash_steps=1)
    assert sizer.size_for(0, 16) == 2 and sizer.size_for(0, 1) == 1  # a batch of fewer runs whole
    sizer.recovered(step=1, size=1)
    assert sizer.size == 2
    assert not sizer.allocator_retried(True, 2, 16) and sizer.size == 2
    thrashing = MicroBatchSizer(size=3, min_size=2, thrash_steps=1)
    assert thrashing.allocator_retried(True, 1, 16) and thrashing.size == 2  # halve(3) = 2
    assert not thrashing.allocator_retried(True, 2, 16) and thrashing.size == 2
    four = MicroBatchSizer(size=4, min_size=3, thrash_steps=1)
    assert four.allocator_retried(True, 1, 16) and four.size == 3  # halve(4) = 2, raised to 3
