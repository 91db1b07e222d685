"""Evaluation under DDP without duplicates: each rank takes every world-size-th sample, nothing padded."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch.distributed as dist
from torch.utils.data import DistributedSampler


class ShardedEvaluationSampler(DistributedSampler):
    """Rank ``r`` of ``W`` takes samples ``r, r + W, r + 2W, …``: each sample exactly once over all ranks.

    Lightning's default ``DistributedSampler`` pads the dataset to a multiple of ``W`` with repeats,
    which counts them twice in validation metrics. Ranks here may get one sample (and one batch)
    fewer: evaluation has no per-batch collectives, and Lightning weighs epoch means by batch size
    over the ranks. Every rank needs a batch, though (see :func:`evaluation_sampler`). Being a
    ``DistributedSampler``, Lightning keeps it instead of inserting its own.

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


def evaluation_sampler(dataset: Sized, sharded_model: bool = False) -> ShardedEvaluationSampler | None:
    """A :class:`ShardedEvaluationSampler` while a multi-rank process group runs, else ``None``.

    ``None`` means in order on one device, and under DDP Lightning's padding sampler: that is kept
    for a set smaller than the world size, where some rank would get no batch, skip the loop, and
    leave the others waiting in its end-of-epoch collectives. It is kept as well for a
    ``sharded_model`` (FSDP), whose every forward gathers parameters with the other ranks: they
    must run the same number of batches, so a few samples repeat, as Lightning pads them.

    Example::

        >>> evaluation_sampler(range(10)) is None   # no process group: in order
        True
    """
    if sharded_model:
        return None
    if dist.is_available() and dist.is_initialized() and 1 < dist.get_world_size() <= len(dataset):
        return ShardedEvaluationSampler(dataset)
    return None
