"""Recognise out-of-memory errors from any backend, and free what can be freed after one."""

from __future__ import annotations

import gc

import torch
from torch import nn

# Fragments of the messages PyTorch and its libraries raise when memory runs out.
_OOM_MESSAGES = (
    "out of memory",  # CUDA, HIP, XPU, MPS ("MPS backend out of memory"), the caching allocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` means the device ran out of memory (CUDA, cuDNN, cuBLAS, CPU, simulated).

    Example::

        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
        True
        >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    if not isinstance(error, RuntimeError) or not error.args:
        return False
    message = str(error.args[0])
    return any(fragment in message for fragment in _OOM_MESSAGES)


def release_memory(module: nn.Module | None = None, drop_gradients: bool = False) -> int:
    """Free what can be freed after an OOM: gradients (when asked), garbage, the CUDA cache.

    Args:
        module: whose gradients to drop when ``drop_gradients``.
        drop_gradients: set every parameter's ``.grad`` of ``module`` to ``None``.

    Returns:
        Bytes the CUDA allocator gave back (0 without CUDA).

    Example::

        >>> layer = nn.Linear(4, 4)
        >>> layer(torch.ones(1, 4)).sum().backward()
        >>> release_memory(layer, drop_gradients=True)
        0
        >>> layer.weight.grad is None
        True
    """
    if drop_gradients and module is not None:
        for parameter in module.parameters():
            parameter.grad = None
    gc.collect()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()
