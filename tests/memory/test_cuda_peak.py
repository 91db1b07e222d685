"""A monitor's peak resets do not shorten a fit-long reader's peak (the CUDA counter faked on the CPU, and real)."""

import pytest
import torch

from lightning_memopt.memory import figures


class FakeAllocator:
    """``torch.cuda``'s one peak counter per device, driven by the test."""

    def __init__(self):
        self.peaks = {}

    def allocate(self, nbytes, index=0):
        self.peaks[index] = max(self.peaks.get(index, 0), nbytes)

    def max_memory_allocated(self, device):
        return self.peaks.get(device.index, 0)

    def reset_peak_memory_stats(self, device):
        self.peaks[device.index] = 0


@pytest.fixture
def allocator(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(figures, "_high_water", {})
    return fake


def test_the_fit_peak_survives_the_monitors_resets(allocator):
    device = torch.device("cuda", 0)
    figures.mark_peak(device)
    allocator.allocate(700)
    figures.reset_peak(device)  # the monitor's sample ends its window
    allocator.allocate(300)
    assert torch.cuda.max_memory_allocated(device) == 300  # what a plain read would have reported
    assert figures.peak_since_mark(device) == 700
    figures.reset_peak(device)
    allocator.allocate(900)
    assert figures.peak_since_mark(device) == 900


def test_a_new_mark_forgets_the_previous_fit(allocator):
    device = torch.device("cuda", 1)
    allocator.allocate(800, index=1)
    figures.reset_peak(device)
    figures.mark_peak(device)  # the next fit starts
    allocator.allocate(100, index=1)
    assert figures.peak_since_mark(device) == 100
    assert figures.peak_since_mark(torch.device("cuda", 0)) == 0  # devices are kept apart


@pytest.mark.cuda
def test_on_a_gpu_the_peak_of_a_freed_tensor_is_kept_across_a_reset():
    device = torch.device("cuda")
    figures.mark_peak(device)
    baseline = torch.cuda.memory_allocated(device)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del block
    figures.reset_peak(device)
    assert figures.peak_since_mark(device) >= baseline + 64 * 2**20
    assert torch.cuda.max_memory_allocated(device) < baseline + 64 * 2**20
