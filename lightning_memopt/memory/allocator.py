"""The CUDA caching allocator: its settings, its retries, and the out-of-memory errors it raises.

``PYTORCH_CUDA_ALLOC_CONF`` is written before CUDA starts (:func:`configure_allocator`); an out-of-memory
error from any backend is recognised (:func:`is_oom_error`) and what can be freed after one is freed
(:func:`release_memory`). :class:`SimulatedDevice` raises such errors past a byte budget, on any machine.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from lightning_memopt.arguments import check_fraction, check_optional_bool, check_optional_int
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.vocabulary import format_bytes

ENV_VAR = "PYTORCH_CUDA_ALLOC_CONF"
USER_VARIABLES = (ENV_VAR, "PYTORCH_ALLOC_CONF")  # either configures the CUDA allocator (the second since torch 2.9)
AUTO = "auto"


def allocator_settings(
    expandable_segments: bool | str | None = None,
    max_split_size_mb: int | None = None,
    garbage_collection_threshold: float | None = None,
) -> dict[str, str]:
    """Validate allocator options and return them as ``PYTORCH_CUDA_ALLOC_CONF`` key/value strings.

    Args:
        expandable_segments: grow segments instead of allocating new ones (less fragmentation); a
            bool or a word (``"on"`` / ``"off"``, ``"true"`` / ``"false"``, ``"yes"`` / ``"no"``, ``"1"`` / ``"0"``),
            or ``"auto"``: on, unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF`` or
            ``PYTORCH_ALLOC_CONF`` set), whose settings are then left as they are.
        max_split_size_mb: blocks larger than this are never split; must be more than 20.
        garbage_collection_threshold: reclaim cached blocks when usage passes this fraction, in (0, 1).

    Raises:
        ValueError: for a value PyTorch would reject.
        TypeError: a size or threshold that is no number (``"abc"``).

    Example::

        >>> allocator_settings(expandable_segments=True, max_split_size_mb=128)
        {'expandable_segments': 'True', 'max_split_size_mb': '128'}
    """
    settings: dict[str, str] = {}
    if isinstance(expandable_segments, str) and expandable_segments.strip().lower() == AUTO:
        expandable_segments = None if user_configured_allocator() else True
    try:
        expandable_segments = check_optional_bool("expandable_segments", expandable_segments)
    except ValueError as error:
        raise ValueError(str(error).replace("true, false or null", "true, false, null or auto")) from None
    if expandable_segments is not None:
        settings["expandable_segments"] = str(expandable_segments)
    max_split_size_mb = check_optional_int("max_split_size_mb", max_split_size_mb, minimum=21)
    if max_split_size_mb is not None:
        settings["max_split_size_mb"] = str(max_split_size_mb)
    if garbage_collection_threshold is not None:
        threshold = check_fraction(
            "garbage_collection_threshold", garbage_collection_threshold, open_minimum=True, open_maximum=True
        )
        settings["garbage_collection_threshold"] = str(threshold)
    return settings


def user_configured_allocator() -> bool:
    """Whether this process's environment configures the CUDA caching allocator already."""
    return any(os.environ.get(name) for name in USER_VARIABLES)


def configure_allocator(
    expandable_segments: bool | str | None = None,
    max_split_size_mb: int | None = None,
    garbage_collection_threshold: float | None = None,
) -> str | None:
    """Write the options into ``PYTORCH_CUDA_ALLOC_CONF`` (merged with what is set there already).

    Call it before anything touches CUDA: the allocator reads the variable once. A warning says so
    when CUDA is already initialised. Options left ``None`` are not written.

    Returns:
        The variable's new value, or ``None`` when nothing was set.

    Example::

        >>> configure_allocator(garbage_collection_threshold=0.8)
        'garbage_collection_threshold:0.8'
        >>> del os.environ[ENV_VAR]
    """
    settings = allocator_settings(expandable_segments, max_split_size_mb, garbage_collection_threshold)
    if not settings:
        return None
    current = dict(item.split(":", 1) for item in os.environ.get(ENV_VAR, "").split(",") if ":" in item)
    current.update(settings)
    value = ",".join(f"{key}:{val}" for key, val in current.items())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn(
            f"CUDA is already initialised: {ENV_VAR}={value} takes effect only in a new process",
            stacklevel=2,
        )
    os.environ[ENV_VAR] = value
    return value


def allocator_retries(device: torch.device | str) -> int:
    """Times the CUDA caching allocator had to free its cache and retry a failed ``cudaMalloc`` (0 off CUDA).

    A count that rises step after step means the run lives at the edge of memory: every retry
    synchronises the device and costs milliseconds, and the next step may fail outright.

    Example::

        >>> allocator_retries("cpu")
        0
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


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
