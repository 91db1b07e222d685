"""Library workspaces a CUDA step holds beside its tensors: cuBLAS's per handle, cuDNN's per convolution.

The caching allocator counts them in ``torch.cuda.max_memory_allocated``; a tensor tracker sees none.
A profile that plans for CUDA adds them (:class:`MemoryTracker` ``workspace=``):

- cuBLAS: one workspace per handle, allocated at a thread's first matrix product and kept: two in a
  training step (the forward's thread and autograd's device thread), ``cublas_bytes`` each;
- cuDNN: each convolution (forward and backward) runs with a workspace, live only during the kernel,
  of ``conv_factor`` × the larger of its input and output (the algorithms PyTorch's heuristics pick
  grow their workspace with the problem).

The sizes are per device: cuBLAS's is PyTorch's default for the architecture (32 MiB per handle on
Hopper, 8 MiB + 128 KiB before it); ``conv_factor`` is fitted to ``benchmarks/gpu_truth.py``'s
measurements: 1.0 on the H200's rows (0.25 left IResNet r200 4.3 % under, 1.0 3.7 %;
``python benchmarks/calibration/memory_h200.py`` shows every row). Before Hopper it is the H200's until a GPU
of that kind is measured.

Example::

    >>> HOPPER.cublas_bytes // 2**20, HOPPER.transient_bytes(2**20, 2**22) // 2**20
    (32, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_memopt.vocabulary import MIB

CUBLAS_HANDLES = 2  # a training step's threads that run matrix products: the forward's and autograd's device thread
CONVOLUTION_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention", "linear"})


@dataclass(frozen=True)
class LibraryWorkspace:
    """cuBLAS's workspace per handle (bytes) and cuDNN's per convolution (a share of its larger tensor)."""

    cublas_bytes: int
    conv_factor: float

    def transient_bytes(self, input_bytes: int, output_bytes: int) -> int:
        """cuDNN's workspace during one convolution with tensors of these sizes."""
        return int(self.conv_factor * max(input_bytes, output_bytes))


HOPPER = LibraryWorkspace(cublas_bytes=32 * MIB, conv_factor=1.0)
BEFORE_HOPPER = LibraryWorkspace(cublas_bytes=8 * MIB + 128 * 1024, conv_factor=1.0)
