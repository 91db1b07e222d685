"""Offloading: keep the activations saved for the backward pass in host memory, not on the device."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_memopt.memory.tracker import host_memory
from lightning_memopt.private_api import storage_base


class OffloadedTensor(NamedTuple):
    """A saved activation copied to the host, and the device it returns to."""

    device: torch.device
    host: torch.Tensor


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(storage_base(tensor), nn.Parameter)


def _pack(tensor: torch.Tensor) -> torch.Tensor | OffloadedTensor:
    if _is_parameter(tensor):  # weights (and their transposes) are on the device anyway
        return tensor
    pin = tensor.device.type == "cuda"
    with host_memory():
        host = torch.empty_like(tensor, device="cpu", pin_memory=pin)  # same strides: kernels pick the same path
        host.copy_(tensor, non_blocking=pin)
    return OffloadedTensor(tensor.device, host)


def _unpack(packed: torch.Tensor | OffloadedTensor) -> torch.Tensor:
    if isinstance(packed, OffloadedTensor):
        return packed.host.to(packed.device, non_blocking=packed.host.is_pinned())
    return packed


def offload_to_host() -> Any:
    """A context in which tensors saved for backward are copied to (pinned) host memory.

    Parameters stay where they are. On a CPU-only machine the copy saves nothing; a
    :class:`~lightning_memopt.memory.MemoryTracker` counts the copies as host memory, so a CPU run
    shows what offloading saves on a device.

    Example::

        >>> x = torch.randn(64, requires_grad=True)
        >>> with offload_to_host():
        ...     y = (x.sin() * 2).sum()
        >>> y.backward()
        >>> torch.allclose(x.grad, 2 * x.cos())
        True
    """
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
