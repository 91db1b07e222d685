"""Evaluation under DDP without duplicates: each rank takes every world-size-th sample, nothing padded."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch.distributed as dist
from torch.utils.data import DistributedSampler


class ShardedEvaluationSampler(DistributedSampler):
    """Rank ``r`` of ``W`` takes samples ``r, r + W, r + 2W, …``: each sample exactly once over all ranks.

    Lightning's default ``DistributedSampler`` pads the dataset to a multiple of ``W`` with repeats,
    which counts them twice in validation metrics. Ranks here may get one sample (and one batch)
    fewer; evaluation has no per-batch collectives, so that is safe. Being a ``DistributedSampler``,
    Lightning keeps it instead of inserting its own.

    Example::

        >>> list(ShardedEvaluationSampler(range(5), num_replicas=2, rank=1))
        [1, 3]
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)  # type: ignore[arg-type]
        self.total_size = len(dataset)
        self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))


def evaluation_sampler(dataset: Sized) -> ShardedEvaluationSampler | None:
    """A :class:`ShardedEvaluationSampler` while a multi-rank process group runs, else ``None`` (in order)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ShardedEvaluationSampler(dataset)
    return None
