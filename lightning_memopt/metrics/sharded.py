"""Rows spread over ranks: gathered one shard at a time onto the device that keeps them, duplicates found by index."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# the ranks' agreement is the package's one helper (the callbacks' micro-batch runner asks it too); re-exported here
from lightning_memopt.distributed import is_distributed, max_over_ranks

__all__ = [
    "communication_device",
    "first_occurrence",
    "gather_rows",
    "is_distributed",
    "max_over_ranks",
    "rows_per_rank",
]


def communication_device(group: ProcessGroup | None = None, fallback: torch.device | None = None) -> torch.device:
    """Where the group's backend takes tensors: the CPU for gloo / MPI, the current GPU for NCCL, else ``fallback``."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return fallback or torch.device("cpu")


def rows_per_rank(count: int, group: ProcessGroup | None = None, device: torch.device | None = None) -> list[int]:
    """Every rank's number of rows, in rank order (``[count]`` outside DDP)."""
    if not is_distributed(group):
        return [count]
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([count], dtype=torch.long, device=device), group=group)
    return [int(size) for size in sizes]


def gather_rows(
    local: torch.Tensor,
    sizes: list[int],
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """All ranks' rows in rank order, on ``local``'s device, each shard sent from its rank in turn.

    Only one shard at a time passes through the communication ``device``, so CPU-kept rows
    gather under NCCL without the whole set on the GPU. ``keep`` (a mask over all rows) drops
    rows as they arrive. Every rank must call it, with the same ``sizes`` (:func:`rows_per_rank`).

    Example::

        >>> gather_rows(torch.arange(6).view(3, 2), [3], keep=torch.tensor([True, False, True])).tolist()
        [[0, 1], [4, 5]]
    """
    if not is_distributed(group):
        return local if keep is None else local[keep.to(local.device)]
    kept = sum(sizes) if keep is None else int(keep.sum())
    gathered = local.new_empty((kept, *local.shape[1:]))
    rank, filled, start = dist.get_rank(group), 0, 0
    for source, size in enumerate(sizes):
        if size == 0:
            continue
        if source == rank:
            shard = local.to(device)
        else:
            shard = torch.empty((size, *local.shape[1:]), dtype=local.dtype, device=device)
        dist.broadcast(shard, src=_global_rank(group, source), group=group)
        if keep is not None:
            shard = shard[keep[start : start + size].to(shard.device)]
        gathered[filled : filled + shard.shape[0]] = shard
        filled, start = filled + shard.shape[0], start + size
    return gathered


def first_occurrence(indices: torch.Tensor) -> torch.Tensor:
    """A mask that keeps the first of each repeated index (a distributed sampler's padding), in order.

    Example::

        >>> first_occurrence(torch.tensor([4, 2, 4, 7, 2])).tolist()
        [True, True, False, True, False]
    """
    ordered, order = torch.sort(indices, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    keep = torch.empty_like(first)
    keep[order] = first
    return keep


def _global_rank(group: ProcessGroup | None, rank: int) -> int:
    """The global rank of ``group``'s ``rank`` (the same number in the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)
