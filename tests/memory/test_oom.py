import pytest
import torch
from torch import nn

from lightning_memopt.memory import is_oom_error, release_memory


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"),
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 123 bytes."
        ),
        MemoryError(),
    ],
)
def test_recognises_out_of_memory_errors(error):
    assert is_oom_error(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        ValueError("out of memory"),
        KeyError("x"),
        RuntimeError(),
    ],
)
def test_other_errors_are_not_oom(error):
    assert not is_oom_error(error)


def test_a_real_cpu_allocator_failure_is_recognised():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom_error(caught.value)


def test_release_memory_drops_gradients_only_when_asked():
    layer = nn.Linear(3, 3)
    layer(torch.ones(1, 3)).sum().backward()
    assert release_memory(layer) == 0 and layer.weight.grad is not None
    release_memory(layer, drop_gradients=True)
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.cuda
def test_release_memory_returns_cached_cuda_blocks():
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    assert release_memory() >= 64 * 2**20
