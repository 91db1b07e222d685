import torch
from torch.nn import functional as F

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.workspace import LibraryWorkspace

WORKSPACE = LibraryWorkspace(cublas_bytes=4096, conv_factor=0.5)


def test_each_thread_keeps_one_cublas_workspace_from_its_first_product():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    tracker = MemoryTracker(workspace=WORKSPACE)
    with tracker:
        tracker.phase = "forward"
        first = a @ b
        second = a @ b
        tracker.phase = "backward"
        third = a @ b
    products = 3 * first.nbytes
    assert tracker.live_bytes == products + 2 * WORKSPACE.cublas_bytes
    assert [r.op for r in tracker.current().records].count("cublas workspace") == 2
    del second, third


def test_a_convolution_holds_its_cudnn_workspace_while_it_runs_only():
    x, weight = torch.randn(1, 4, 16, 16), torch.randn(8, 4, 3, 3)
    tracker, plain = MemoryTracker(workspace=WORKSPACE), MemoryTracker()
    outputs = []
    for counting in (tracker, plain):
        with counting:
            counting.phase = "forward"
            outputs.append(F.conv2d(x, weight, padding=1))
    out = outputs[0]
    workspace = int(0.5 * out.nbytes)  # the output is its largest tensor
    assert tracker.peak.total_bytes == plain.peak.total_bytes + workspace
    assert tracker.live_bytes == plain.live_bytes == out.nbytes
    assert "cudnn workspace" in [r.op for r in tracker.peak.records]


def test_without_a_workspace_only_tensors_are_counted():
    tracker = MemoryTracker()
    with tracker:
        tracker.phase = "forward"
        product = torch.randn(4, 4) @ torch.randn(4, 4)
    assert tracker.live_bytes == product.nbytes  # the random inputs were freed
