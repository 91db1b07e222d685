"""SimulatedDevice: a byte budget that raises out-of-memory like a GPU, on any machine."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.vocabulary import format_bytes


class SimulatedDevice(MemoryTracker):
    """Count live tensor bytes and raise ``torch.OutOfMemoryError`` past ``budget_bytes``.

    Everything allocated inside the ``with`` block counts (storages once, freed when they die),
    plus the parameters, buffers, gradients and optimizer state of what ``include`` names.
    The error message imitates CUDA's, so code that recognises CUDA OOMs recognises this one.

    Args:
        budget_bytes: the device's capacity in bytes.
        include: modules (parameters, buffers, gradients), optimizers (state) or tensors that live
            on the device already when the block starts.
        round_to: allocation granularity in bytes (512, like the CUDA caching allocator).

    Raises:
        ValueError: for a non-positive ``budget_bytes``.

    Example::

        >>> with SimulatedDevice(budget_bytes=4096):
        ...     a = torch.zeros(512)                 # 2 KiB: fits
        ...     try:
        ...         b = torch.zeros(1024)            # 4 KiB more: does not
        ...     except torch.OutOfMemoryError as error:
        ...         print(str(error).split(".")[0])
        CUDA out of memory
    """

    def __init__(
        self,
        budget_bytes: int,
        include: Iterable[nn.Module | torch.optim.Optimizer | torch.Tensor] = (),
        round_to: int = 512,
    ) -> None:
        super().__init__(round_to=round_to)
        if budget_bytes <= 0:
            raise ValueError(f"`budget_bytes`={budget_bytes!r} must be positive")
        self.budget_bytes = int(budget_bytes)
        self.oom_count = 0
        for item in include:
            self.include(item)

    def include(self, item: nn.Module | torch.optim.Optimizer | torch.Tensor) -> None:
        """Count something that already lives on the device."""
        if isinstance(item, nn.Module):
            self.track(item.parameters(), "parameters", op="parameter")
            self.track(item.buffers(), "parameters", op="buffer")
            self.track((p.grad for p in item.parameters()), "gradients", op="gradient")
        elif isinstance(item, torch.optim.Optimizer):
            self.track_optimizer(item)
        elif isinstance(item, torch.Tensor):
            self.track([item], "inputs")
        else:
            raise TypeError(f"`include` takes modules, optimizers or tensors, got {type(item).__name__}")

    def _before_allocation(self, nbytes: int, op: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if self.live_bytes + nbytes <= self.budget_bytes:
            return
        self.oom_count += 1
        free = max(0, self.budget_bytes - self.live_bytes)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)} (simulated). The simulated device has a "
            f"total capacity of {format_bytes(self.budget_bytes)} of which {format_bytes(free)} is free. "
            f"{format_bytes(self.live_bytes)} is allocated by tensors. Failing op: {op} {list(shape)} {dtype}."
        )
