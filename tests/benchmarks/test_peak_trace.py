"""benchmarks/gpu_truth/peak_trace.py: the allocator's trace replayed to its peak, the live blocks grouped by the line
that made them."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt.private_api import cuda_memory_snapshot, record_cuda_memory_history
from tests.helpers import load_benchmark

peak_trace = load_benchmark("gpu_truth.peak_trace")
PeakGroup, describe, live_at_peak = peak_trace.PeakGroup, peak_trace.describe, peak_trace.live_at_peak

MODEL = [{"filename": "/site-packages/torch/nn/modules/conv.py", "line": 5, "name": "_conv_forward"},
         {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1, "name": "malloc"},
         {"filename": "/work/model.py", "line": 40, "name": "forward"}]  # fmt: skip
LOSS = [{"filename": "/work/loss.py", "line": 7, "name": "margin"}]
KIB = 1024


def _alloc(addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr: int, size: int, action: str = "free_completed") -> dict:
    return {"action": action, "addr": addr, "size": size}


def test_the_peak_is_the_most_bytes_allocated_at_once_and_its_blocks_are_grouped_by_the_code_that_asked():
    trace = [
        _alloc(1, 3 * KIB, MODEL),
        _alloc(2, 2 * KIB, MODEL),
        _alloc(3, KIB, LOSS),  # the peak: 6 KiB
        _free(1, 3 * KIB, "free_requested"),  # no longer allocated, though a stream may still use it
        _free(99, 4096, "free_requested"),  # a block from before the history started: not in the count
        _alloc(4, 2 * KIB, []),
        _free(1, 3 * KIB),  # the free completing changes nothing more
        _alloc(5, 100, LOSS),  # counted as the allocator's 512 bytes
    ]
    peak, groups = live_at_peak({"device_traces": [[], trace]}, device=1)
    assert peak == 6 * KIB
    assert groups == [
        PeakGroup("/work/model.py:40 forward", 5 * KIB, 2),
        PeakGroup("/work/loss.py:7 margin", KIB, 1),
    ]
    assert describe(groups) == "model.py:40 forward 0.0 MiB ×2; loss.py:7 margin 0.0 MiB ×1"
    later = live_at_peak({"device_traces": [trace + [_alloc(6, 4 * KIB, LOSS)]]})[0]  # blocks 2, 3, 4, 5 and 6
    assert later == (2 + 1 + 2 + 4) * KIB + 512


def test_blocks_with_no_python_frame_outside_torch_are_grouped_together_and_only_the_top_groups_kept():
    torch_only = [{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "backward"}]
    trace = [_alloc(i, KIB * (i + 1), torch_only if i < 2 else [{**LOSS[0], "line": i}]) for i in range(5)]
    peak, groups = live_at_peak({"device_traces": [trace]}, top=2)
    assert peak == sum(KIB * (i + 1) for i in range(5))
    assert [(group.where, group.bytes) for group in groups] == [
        ("/work/loss.py:4 margin", 5 * KIB),
        ("/work/loss.py:3 margin", 4 * KIB),
    ]
    assert PeakGroup("(no Python frame outside torch)", 3 * KIB, 2) in live_at_peak({"device_traces": [trace]})[1]


@pytest.mark.cuda
def test_a_cuda_trace_names_this_file_for_the_tensors_live_at_the_peak():
    device = torch.device("cuda")
    record_cuda_memory_history(True, stacks="python")
    try:
        kept = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        passing = torch.empty(32 * 2**20, dtype=torch.uint8, device=device)
        del passing
        snapshot = cuda_memory_snapshot(device)
    finally:
        record_cuda_memory_history(False)
    peak, groups = live_at_peak(snapshot, torch.cuda.current_device())
    assert peak >= 96 * 2**20 and kept.numel()
    assert groups[0].where.split(":")[0].endswith("test_peak_trace.py") and groups[0].bytes >= 64 * 2**20
