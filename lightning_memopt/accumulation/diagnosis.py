"""Why the smallest micro-batch does not fit: a fake-mode memory profile of a training step on it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_memopt.accumulation.errors import SampleOutOfMemoryError
from lightning_memopt.memory.profile import profile_step
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import PROFILE_PRECISIONS


def with_profile(
    error: SampleOutOfMemoryError,
    module: nn.Module,
    precision: str = "32-true",
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    unwrapped: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> SampleOutOfMemoryError:
    """``error`` again, with a fake-mode memory profile of a training step on the sample that failed.

    The profile is a diagnosis: when it cannot be made, the message says why and the error is kept.
    A module with ``SyncBatchNorm`` is not profiled (its forward would wait for ranks that have stopped).

    Args:
        error: what the micro-batch runner raised; its ``sample`` is profiled.
        module: a LightningModule (its own ``training_step`` and optimizer), or a plain module with
            ``loss_fn`` and ``optimizer`` (see :func:`~lightning_memopt.memory.profile_step`).
        precision: the run's precision (one that :func:`profile_step` does not know profiles as ``"32-true"``).
        loss_fn: ``loss_fn(module, batch) -> loss`` for a plain module.
        optimizer: an optimizer or a factory of one, for a plain module.
        unwrapped: a context in which ``module``'s step is its own (not a wrapper that splits batches).

    Example::

        >>> model = nn.Linear(64, 64)
        >>> error = SampleOutOfMemoryError("a micro-batch of one sample does not fit", torch.randn(1, 64), size=1)
        >>> profiled = with_profile(error, model, loss_fn=lambda m, x: m(x).sum(), optimizer=torch.optim.SGD)
        >>> profiled.profile.peak_bytes > 0, "A training step on that one sample" in str(profiled)
        (True, True)
    """
    if error.sample is None or any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        return error  # (a SyncBatchNorm forward would wait for ranks that have stopped)
    precision = precision if precision in PROFILE_PRECISIONS else "32-true"
    try:
        with disable_current_modes(), unwrapped():
            profile = profile_step(
                module, error.sample, loss_fn=loss_fn, optimizer=optimizer, mode="fake", precision=precision
            )
    except Exception as failure:  # the profile is a diagnosis: its own failure must not hide the OOM
        return SampleOutOfMemoryError(
            f"{error}\n(no memory profile: {type(failure).__name__}: {failure})", error.sample, size=error.size
        )
    what = {1: "that one sample", None: "that batch"}.get(error.size, f"those {error.size} samples")
    return SampleOutOfMemoryError(
        f"{error}\nA training step on {what}, predicted in fake mode:\n{profile.table()}\n"
        "Lower the memory per sample: ActivationCheckpointing, PrecisionSwitch('auto'), a smaller input or model",
        error.sample,
        profile,
        size=error.size,
    )
