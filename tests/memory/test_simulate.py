import pytest
import torch
from torch import nn

from lightning_memopt.memory import SimulatedDevice, is_oom_error


def test_raises_exactly_past_the_budget():
    with SimulatedDevice(budget_bytes=4096, round_to=1) as device:
        a = torch.zeros(1024)  # 4096 B: exactly the budget
        assert device.live_bytes == 4096
        with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to allocate 0\.00 MiB"):
            torch.zeros(1)
        assert device.oom_count == 1 and device.live_bytes == 4096
    assert a.numel() == 1024


def test_frees_as_tensors_die_so_the_next_allocation_fits():
    with SimulatedDevice(budget_bytes=8192, round_to=1) as device:
        a = torch.zeros(1536)  # 6144 B
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(1024)
        del a
        b = torch.zeros(1024)
        assert device.live_bytes == 4096
    assert b.numel() == 1024


def test_included_module_and_optimizer_count_against_the_budget():
    layer = nn.Linear(256, 256)  # 65792 parameters = 263168 B
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    device = SimulatedDevice(budget_bytes=10**6, include=[layer, optimizer], round_to=1)
    breakdown = device.current().by_category()
    assert breakdown["parameters"] == breakdown["gradients"] == breakdown["optimizer_state"] == 263168


def test_a_training_step_that_does_not_fit_raises_a_recognised_oom():
    model = nn.Sequential(nn.Linear(512, 4096), nn.ReLU(), nn.Linear(4096, 512))
    with pytest.raises(torch.OutOfMemoryError) as caught, SimulatedDevice(budget_bytes=2 * 2**20, include=[model]):
        model(torch.randn(64, 512)).sum().backward()
    assert is_oom_error(caught.value)
    assert "The simulated device has a total capacity of 2.00 MiB" in str(caught.value)


@pytest.mark.parametrize("budget", [0, -5])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match=rf"`budget_bytes`={budget} must be positive"):
        SimulatedDevice(budget)


def test_include_refuses_other_things():
    with pytest.raises(TypeError, match="`include` takes modules, optimizers or tensors, got str"):
        SimulatedDevice(1024, include=["model"])
