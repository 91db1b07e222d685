"""DDP communication hooks by name: plain all-reduce, fp16 / bf16 compression, PowerSGD."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_memopt.arguments import check_bool, check_int
from lightning_memopt.strategies.powersgd_state import ResumablePowerSGD

COMM_HOOKS = ("none", "allreduce", "fp16", "bf16", "powersgd")
CommHookName = Literal["none", "allreduce", "fp16", "bf16", "powersgd"]  # == COMM_HOOKS


def check_powersgd_options(rank: Any, warmup: Any, error_feedback: Any) -> tuple[int, int, bool]:
    """The PowerSGD options in their proper types; raise naming a bad one.

    Raises:
        TypeError: a rank or warm-up that is no integer (``"abc"``, ``True``).
        ValueError: a rank below 1, a warm-up below 2, or ``error_feedback`` neither a bool nor a
            word such as ``"on"`` / ``"off"``.

    Example::

        >>> check_powersgd_options(2, 100.0, "off")
        (2, 100, False)
    """
    rank = check_int("powersgd_rank", rank, minimum=1)
    try:
        warmup = check_int("powersgd_warmup", warmup, minimum=2)
    except ValueError as error:
        raise ValueError(
            f"{error}: PowerSGD starts after DDP's first two iterations, which run plain all-reduce"
        ) from None
    return rank, warmup, check_bool("error_feedback", error_feedback)


def comm_hook(
    name: str,
    model: nn.Module,
    process_group: ProcessGroup | None = None,
    powersgd_rank: int = 1,
    powersgd_warmup: int = 1000,
    error_feedback: bool = True,
) -> tuple[Any, Callable | None]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``; ``(None, None)`` for ``"none"``.

    ``"allreduce"`` is DDP's own averaging as a Python hook (the baseline whose traffic can be
    counted); ``"fp16"`` / ``"bf16"`` send gradients in half precision; ``"powersgd"`` sends rank-``r``
    factors after ``powersgd_warmup`` plain iterations, with error feedback
    (:class:`~lightning_memopt.strategies.powersgd_state.ResumablePowerSGD`, whose state follows
    ``model``'s parameters, not DDP's buckets).

    Raises:
        ValueError: for an unknown ``name`` or a bad PowerSGD option.

    Example::

        >>> comm_hook("fp16", torch.nn.Linear(2, 2))[1].__name__
        'float16_allreduce_hook'
    """
    if not isinstance(name, str) or name not in COMM_HOOKS:
        raise ValueError(f"Unknown `comm_hook`={name!r}; valid choices: {', '.join(COMM_HOOKS)}")
    if name == "powersgd":
        powersgd_rank, powersgd_warmup, error_feedback = check_powersgd_options(
            powersgd_rank, powersgd_warmup, error_feedback
        )
        state = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_warmup,
            use_error_feedback=error_feedback,
        )
        return state, ResumablePowerSGD(state, model)
    hooks = {
        "none": None,
        "allreduce": default_hooks.allreduce_hook,
        "fp16": cast_allreduce_hook(torch.float16),
        "bf16": cast_allreduce_hook(torch.bfloat16),
    }
    return (None if name == "none" else process_group), hooks[name]


def cast_allreduce_hook(dtype: torch.dtype) -> Callable:
    """A hook that averages each gradient bucket in ``dtype`` (half the bytes of fp32) and writes it back.

    The same computation as torch's ``fp16_compress_hook`` / ``bf16_compress_hook``; torch refuses
    its bf16 hook off CUDA / NCCL, while gloo reduces bf16 tensors fine, so the presets use this one.

    Example::

        >>> cast_allreduce_hook(torch.bfloat16).__name__
        'bfloat16_allreduce_hook'
    """

    def hook(process_group, bucket):  # unannotated: DDP rejects string annotations of a hook
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def write_back(done: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(write_back)

    hook.__name__ = hook.__qualname__ = f"{str(dtype).removeprefix('torch.')}_allreduce_hook"
    return hook
