"""What a batch that cannot be completed in micro-batches raises, and the messages that say why.

The errors; the profile that says why the smallest micro-batch does not fit (:func:`with_profile`); and what
recovery did, said once on rank zero through Lightning's rank-zero logging (:func:`log_info`, :func:`log_warning`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.profile import profile_step
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import PROFILE_PRECISIONS

OOM, SIZE = 1, 2  # what stopped a batch, as ranks agree on it (the larger wins)


class SampleOutOfMemoryError(torch.OutOfMemoryError):
    """Even the smallest micro-batch the model takes runs out of memory, or a batch that cannot be split does.

    The smallest is one sample, or more for a model that takes no fewer (``MicroBatchRunner.min_size``:
    two with batch norm in training); a piece that cannot be cut into pieces of at least that many
    samples fails the same way.

    Attributes:
        sample: what failed: the smallest micro-batch, or the whole batch that cannot be split
            (``None`` on the ranks where another rank failed).
        profile: a :class:`~lightning_memopt.memory.MemoryProfile` of a step on that sample, when known.
        size: how many samples ``sample`` holds (``None`` when unknown).
    """

    def __init__(self, message: str, sample: Any = None, profile: Any = None, size: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample
        self.profile = profile
        self.size = size


class MicroBatchSizeError(ValueError):
    """A micro-batch smaller than those already tried raised an error: the model does not take so few samples.

    The batch cannot be completed (its earlier micro-batches are already accumulated), but the
    runner has learned the minimum: later batches are cut into micro-batches of at least ``min_size``.
    The original error is the ``__cause__``.

    Attributes:
        size: the micro-batch size the model rejected (``None`` on the ranks where another rank failed).
        min_size: the smallest micro-batch size from now on.
    """

    def __init__(self, message: str, size: int | None = None, min_size: int = 1) -> None:
        super().__init__(message)
        self.size = size
        self.min_size = min_size


class RanksOutOfStepError(RuntimeError):
    """A step failed in the middle of its collectives (FSDP): the ranks cannot realign, every rank stops.

    The rank whose step ran out of memory says so; the other ranks say that a collective failed
    because another rank stopped. Both name the micro-batch size to resume with.

    Attributes:
        rank: the rank raising it.
        micro_batch_size: the micro-batch size the step ran with (the whole batch's size without micro-batches).
        resume_size: the micro-batch size to resume from the last checkpoint with (``None``: none is smaller).
    """

    def __init__(self, message: str, rank: int, micro_batch_size: int | None, resume_size: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.resume_size = resume_size


@dataclass
class Failure:
    """What stopped a batch on this rank."""

    kind: int  # OOM: a piece that cannot be split ran out of memory; SIZE: a piece too small for the model
    start: int  # the samples that failed
    stop: int
    message: str  # the error: "type: message"
    cause: BaseException | None = None  # a non-OOM error that taught the minimum


def failure_error(
    failure: Failure | None,
    agreed: int,
    min_size: int,
    min_size_reason: str | None,
    unsplittable: Exception | None,
    batch: Any,
    piece: Any,
) -> tuple[Exception, BaseException | None]:
    """The error every rank raises when some rank's batch failed, and its cause.

    Args:
        failure: what stopped this rank's batch (``None``: another rank's did).
        agreed: the kind the ranks agreed on (:data:`OOM` or :data:`SIZE`).
        min_size: the smallest micro-batch the model takes now; ``min_size_reason`` says why.
        unsplittable: why the batch can only run whole (``None``: it can be split).
        batch: the whole batch; ``piece``: the samples that failed.
    """
    if failure is None:
        if agreed == SIZE:
            return MicroBatchSizeError(
                "AdaptiveAccumulation: another rank ran a micro-batch smaller than the model takes; every rank "
                f"stops together. Later batches are cut into micro-batches of at least {min_size} samples",
                min_size=min_size,
            ), None
        return SampleOutOfMemoryError(
            "AdaptiveAccumulation: another rank ran out of memory on a piece it cannot split further; "
            "every rank stops together"
        ), None
    samples = failure.stop - failure.start
    if failure.kind == SIZE:
        return MicroBatchSizeError(
            f"AdaptiveAccumulation: a micro-batch of {count_samples(samples)} raised {shorten(failure.message)}, "
            f"after larger micro-batches ran: the model takes no fewer than {min_size} samples. This batch "
            "cannot be completed (its earlier micro-batches are accumulated already); later batches are cut into "
            f"micro-batches of at least {min_size} samples",
            size=samples,
            min_size=min_size,
        ), failure.cause
    if unsplittable is not None:
        return SampleOutOfMemoryError(
            f"AdaptiveAccumulation: the batch ran out of memory ({failure.message}) and cannot be split into "
            f"micro-batches: {unsplittable}",
            sample=batch,
        ), failure.cause
    why = f" ({min_size_reason})" if min_size_reason else ""
    if samples == min_size == 1:
        what = "a micro-batch of one sample does not fit"
    elif samples == min_size:
        what = f"a micro-batch of {samples} samples, the smallest the model takes{why}, does not fit"
    elif samples > min_size:
        what = (
            f"a micro-batch of {samples} samples does not fit, and it cannot be cut into micro-batches of at "
            f"least {min_size} samples, the smallest the model takes{why}"
        )
    else:
        what = f"a batch of {count_samples(samples)} does not fit, and the model takes no fewer than {min_size}{why}"
    return SampleOutOfMemoryError(
        f"AdaptiveAccumulation: {what} ({failure.message})", sample=piece, size=samples
    ), failure.cause


def count_samples(count: int) -> str:
    """``"1 sample"``, ``"3 samples"``."""
    return "1 sample" if count == 1 else f"{count} samples"


def shorten(message: str, limit: int = 300) -> str:
    """``message`` cut to ``limit`` characters, ending in ``...`` when cut."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


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


def log_info(message: str) -> None:
    """Log ``message`` at INFO on rank zero (``lightning.fabric.utilities.rank_zero.rank_zero_info``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    rank_zero_info(message)


def log_warning(message: str) -> None:
    """Warn with ``message`` on rank zero (``lightning.fabric.utilities.rank_zero.rank_zero_warn``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(message, stacklevel=5)  # (the warning's place: the line that called this function)
