"""Ranks in lockstep (FSDP): an error in the middle of a step stops every rank at once, saying how to resume.

Under FSDP every micro-batch's forward and backward passes are collectives (each unit's all-gather
and reduce-scatter), so a rank that fails in the middle leaves the others waiting in them, and the
ranks cannot realign. The rank that fails aborts its process groups, so that the others' pending
collectives fail now instead of at their timeout, and every rank stops with a
:class:`~lightning_memopt.accumulation.RanksOutOfStepError` naming the micro-batch size to resume with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lightning_memopt.accumulation.errors import RanksOutOfStepError, count_samples
from lightning_memopt.accumulation.sizing import count_pieces
from lightning_memopt.memory.allocator import is_oom_error
from lightning_memopt.private_api import abort_process_groups

TRAINING_STEP = "training_step"


@dataclass(frozen=True)
class Lockstep:
    """This rank's place among ranks whose steps are collectives: a failing rank stops them all.

    Args:
        rank: this process's global rank.
        world_size: how many ranks run the step (the process groups are aborted only when more than one).

    Example::

        >>> lockstep = Lockstep(rank=0, world_size=1)
        >>> try:
        ...     with lockstep.stop_every_rank_on_error("validation_step", None, 16):
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ... except RanksOutOfStepError as error:
        ...     print(str(error)[:95])
        AdaptiveAccumulation: out of memory on rank 0 in validation_step with whole batches of 16 under
    """

    rank: int
    world_size: int

    @contextlib.contextmanager
    def stop_every_rank_on_error(
        self,
        hook: str,
        size: int | None,
        total: int | None,
        step: int | None = None,
        resume_size: Callable[[int | None], int | None] | None = None,
    ) -> Iterator[None]:
        """Turn an out-of-memory error, or a collective failing after another rank's, into a RanksOutOfStepError.

        Args:
            hook: the step hook running (``"training_step"``, ``"validation_step"``, ...).
            size: the micro-batch size of the step; ``total``: the batch's (``None``: whole, a batch that
                cannot be split).
            step: the optimizer step (training).
            resume_size: ``size -> the micro-batch size to resume with`` (training; ``None``: none is smaller).
        """
        try:
            yield
        except Exception as error:
            if self.world_size > 1:
                abort_process_groups()
            resume = resume_size(size) if resume_size is not None and hook == TRAINING_STEP else None
            stopped = out_of_step_error(error, self.rank, hook, size, total, step, resume)
            if stopped is None:
                raise
            raise stopped from error


def out_of_step_error(
    error: BaseException,
    rank: int,
    hook: str,
    size: int | None,
    total: int | None,
    step: int | None = None,
    resume: int | None = None,
) -> RanksOutOfStepError | None:
    """What every rank stops with after ``error``: this rank's out-of-memory error, or another rank's leaving.

    ``None`` for any other error (it is raised as it is). The arguments are those of
    :meth:`Lockstep.stop_every_rank_on_error`, with ``resume`` the size to resume with.
    """
    oom = is_oom_error(error)
    if not oom and not collective_failed(error):
        return None
    batches = describe_batches(size, total)
    if hook == TRAINING_STEP:
        where = f"at step {step} with {batches}"
        advice = (
            f"resume from the last checkpoint with AdaptiveAccumulation(micro_batch_size={resume}), or plan the "
            "run (memopt=planned)"
            if resume is not None
            else "lower the memory per sample (ActivationCheckpointing, PrecisionSwitch('auto'), "
            "MemoptFSDPStrategy(cpu_offload=True)) and resume from the last checkpoint"
        )
    else:
        where, resume = f"in {hook} with {batches}", None
        advice = f"give the {hook.removesuffix('_step')} dataloader smaller batches"
    if oom:
        cause = f"{type(error).__name__}: {str(error)[:160]}"
        what = f"out of memory on rank {rank} {where} under fsdp_memopt ({cause})"
        then = f"To go on, {advice}."
    else:
        what = f"a collective failed on rank {rank} {where} under fsdp_memopt: another rank stopped in the middle"
        then = f"That rank's error says why; after an out-of-memory error there, {advice}."
    return RanksOutOfStepError(
        f"AdaptiveAccumulation: {what}. The ranks cannot realign in the middle of a step (its forward and backward "
        f"passes are collectives: each unit's all-gather and reduce-scatter), so every rank stops. {then}",
        rank,
        size,
        resume,
    )


def check_same_pieces(agree: Callable[[list[int]], list[int]], total: int, size: int, least: int) -> None:
    """Raise on every rank unless every rank cuts its batch (``total`` samples) into as many micro-batches.

    Args:
        agree: the element-wise maximum over ranks (see :func:`~lightning_memopt.distributed.max_over_ranks`).
        total: this rank's batch size; ``size``: the micro-batch size; ``least``: the smallest piece.

    Raises:
        ValueError: when the ranks' batches make different numbers of micro-batches.
    """
    pieces = count_pieces(total, size, least)
    most, negative_fewest = agree([pieces, -pieces])
    if most != -negative_fewest:
        raise ValueError(
            f"in lockstep every rank runs as many micro-batches, but the ranks' batches make {-negative_fewest} "
            f"to {most} (here a batch of {count_samples(total)} in micro-batches of {size} makes {pieces}); give "
            "every rank batches of the same size"
        )


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank left: torch's typed errors, gloo's messages."""
    return isinstance(error, torch.distributed.DistError) or "/gloo/" in str(error)


def describe_batches(size: int | None, total: int | None) -> str:
    """``"micro-batches of 8 (of 16)"``, ``"whole batches of 16"`` or ``"a batch that cannot be split"``."""
    if total is None:
        return "a batch that cannot be split"
    if size is None or size >= total:
        return f"whole batches of {total}"
    return f"micro-batches of {size} (of {total})"
