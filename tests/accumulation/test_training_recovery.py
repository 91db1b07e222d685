"""The functional core of AdaptiveAccumulation, driven without a Trainer: plain modules, injected or simulated OOMs."""

import pytest
import torch
from torch import nn

from lightning_memopt.accumulation import (
    EvaluationChunks,
    Lockstep,
    MicroBatchSizer,
    RanksOutOfStepError,
    SampleOutOfMemoryError,
    TrainingRecovery,
    deliver,
    scaled_backward,
    with_profile,
)
from lightning_memopt.memory import MemoryTracker, SimulatedDevice
from tests.accumulation.test_micro_batch_runner import (
    BATCH,
    Net,
    assert_close,
    injected_oom,
    loss_fn,
    reference_gradients,
)


def recovering(model, size=None, **sizer):
    recovery = TrainingRecovery(MicroBatchSizer(size, **sizer))
    recovery.attach(model)
    return recovery


@pytest.mark.parametrize("fault", ["forward_limit", "backward_limit"])
def test_a_recovered_batch_delivers_the_whole_batch_gradient(fault):
    model = Net(**{fault: 4})
    recovery = recovering(model)
    result = recovery.run(loss_fn(model), BATCH, global_step=0, backward=torch.Tensor.backward)
    assert result.recovered and recovery.sizer.size == 4 and recovery.sizer.oom_recoveries == 1
    assert (recovery.last_micro_batch_size, recovery.last_micro_batches) == (4, len(result.sizes))
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))

    # the loop's own backward on the delivered loss puts them back, whatever gradient reaches it
    output = deliver(model, result)
    assert all(p.grad is None for p in model.parameters())
    output.backward(torch.tensor(0.25))
    assert_close([p.grad for p in model.parameters()], reference_gradients(BATCH))
    torch.testing.assert_close(output.detach(), loss_fn(Net())(BATCH).detach())

    # the next batch starts at the size that worked
    model.zero_grad()
    assert recovery.run(loss_fn(model), BATCH, global_step=1, backward=torch.Tensor.backward).sizes == [4, 4, 4, 1]


def test_a_simulated_device_forces_the_recovery_and_the_gradients_stay_exact():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 4096), nn.Tanh(), nn.Linear(4096, 3))

    x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(2)), torch.randn(32, 3)

    def step(network):
        return lambda batch: (network(batch[0]) - batch[1]).pow(2).sum(dim=1).mean()

    reference = model()
    tracker = MemoryTracker()
    with tracker:
        step(reference)((x[:8], y[:8])).backward()
    budget = tracker.peak.total_bytes + sum(p.numel() * 8 for p in reference.parameters())  # room for 8, not 32
    reference.zero_grad(set_to_none=True)
    step(reference)((x, y)).backward()

    network = model()
    recovery = recovering(network)
    with SimulatedDevice(budget, include=[network]) as device:
        result = recovery.run(step(network), (x, y), global_step=0, backward=scaled_backward(torch.Tensor.backward))
    assert device.oom_count >= 1 and result.recovered and recovery.sizer.size <= 8
    assert_close([p.grad for p in network.parameters()], [p.grad for p in reference.parameters()])


def test_the_smallest_micro_batch_that_does_not_fit_is_diagnosed():
    model = Net(forward_limit=0)
    recovery = recovering(model)
    with pytest.raises(SampleOutOfMemoryError, match="a micro-batch of one sample does not fit") as info:
        recovery.run(loss_fn(model), BATCH, global_step=0, backward=torch.Tensor.backward)
    assert info.value.size == 1
    profiled = with_profile(info.value, Net(), loss_fn=lambda m, batch: loss_fn(m)(batch), optimizer=torch.optim.SGD)
    assert profiled.profile is not None and "A training step on that one sample, predicted in fake mode" in str(
        profiled
    )


def test_in_lockstep_an_oom_stops_the_step_and_names_the_size_to_resume_with():
    model = Net(forward_limit=4)
    recovery = TrainingRecovery(MicroBatchSizer(8))
    recovery.attach(model, lockstep=Lockstep(rank=0, world_size=1))
    with pytest.raises(RanksOutOfStepError) as info:
        recovery.run(loss_fn(model), BATCH, global_step=3, backward=torch.Tensor.backward)
    assert "out of memory on rank 0 at step 3 with micro-batches of 8 (of 13) under fsdp_memopt" in str(info.value)
    assert "resume from the last checkpoint with AdaptiveAccumulation(micro_batch_size=4)" in str(info.value)
    assert (info.value.micro_batch_size, info.value.resume_size) == (8, 4)


def test_the_state_goes_on_in_another_recovery():
    model = Net(forward_limit=4)
    first = recovering(model, grow_after=50)
    first.run(loss_fn(model), BATCH, global_step=0, backward=torch.Tensor.backward)
    state = first.state_dict()
    assert state["size"] == 4 and state["learned_min_size"] is None
    resumed = recovering(Net(), grow_after=50)  # restored after attach: the runner takes it at once
    resumed.load_state_dict(state)
    assert resumed.sizer.size == 4 and resumed.sizer.oom_recoveries == 1


def test_an_unattached_recovery_says_so():
    with pytest.raises(RuntimeError, match="call `attach\\(module\\)` first"):
        TrainingRecovery(MicroBatchSizer()).run(lambda x: x.sum(), torch.ones(2), global_step=0, backward=print)


def test_evaluation_chunks_give_the_whole_batch_outputs():
    model = Net(forward_limit=3)
    chunks = EvaluationChunks()
    chunks.attach(model)
    with torch.no_grad():
        output = chunks.run(lambda x: model(x), BATCH[0], "test_step")
        expected = Net()(BATCH[0])
    torch.testing.assert_close(output, expected)
    assert chunks.micro_batch_size == 2  # 13 → 7 → 4 → 2
    with pytest.raises(SampleOutOfMemoryError):
        chunks.run(lambda x: (_ for _ in ()).throw(injected_oom()), BATCH[0])
