"""Ranks agreeing on a few numbers: the one all-reduce the package uses wherever every rank must decide alike.

A metric deciding which buffers changed and the micro-batch runner deciding whether any rank ran out of memory
ask the same question: the element-wise maximum of a few ints over the ranks. Both ask it here. Outside a
process group of more than one rank the values come back as they are, so the same code runs on one process.

Example::

    >>> max_over_ranks([3, 0, 1])  # one process: nothing to agree with
    [3, 0, 1]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["is_distributed", "max_over_ranks"]


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """Whether a process group with more than one rank is running.

    Example::

        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def max_over_ranks(
    values: list[int], group: ProcessGroup | None = None, device: torch.device | None = None
) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks (the values themselves outside DDP).

    One all-reduce and no barrier: every rank of ``group`` must call it, with as many values.

    Args:
        values: this rank's ints (flags as 0 / 1; a minimum as its negation).
        group: the process group (``None``: the default one).
        device: where the backend takes tensors: the CPU for gloo, the rank's GPU for NCCL.

    Example::

        >>> smallest, failed = max_over_ranks([-8, 0])  # the smallest size anywhere, whether any rank failed
        >>> -smallest, bool(failed)
        (8, False)
    """
    if not is_distributed(group):
        return [int(value) for value in values]
    reduced = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced.tolist()
