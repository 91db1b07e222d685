"""`LoaderDataModule`: loader options, build-once datasets and saved hyperparameters for dict-batch datamodules.

Evaluation under DDP reads no sample twice: each rank takes every world-size-th sample, nothing padded
(:class:`ShardedEvaluationSampler`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_memopt.arguments import check_bool, check_int, check_optional_int
from lightning_memopt.data.resumable import ResumableDataLoader, run_seed


class LoaderDataModule(LightningDataModule):
    """Base of datamodules whose samples are dicts of tensors (batches then split along dim 0).

    A subclass implements ``_build_datasets()``, returning ``(train, val)`` (``val`` may be None);
    they are built once, on the first ``setup()``. The constructor arguments of the subclass are
    saved as hyperparameters (pass plain values; Hydra configs use ``_convert_: all``).

    Args:
        batch_size: training batch size, at least 1.
        val_batch_size: validation batch size; ``None`` means ``batch_size``.
        num_workers: DataLoader worker processes, at least 0.
        pin_memory: pin batches in page-locked memory (faster host-to-GPU copies).
        persistent_workers: keep workers alive between epochs; needs ``num_workers > 0``.
        drop_last: drop the last incomplete training batch.

    Raises:
        ValueError: an argument is out of range (or a boolean is not true / false).
        TypeError: an argument has the wrong kind (``batch_size="abc"``).

    Example::

        >>> from lightning_memopt.data import SyntheticNormalsDataModule
        >>> dm = SyntheticNormalsDataModule(num_samples=4, image_size=(32, 24), batch_size=2)
        >>> {key: tuple(value.shape) for key, value in next(iter(dm.train_dataloader())).items()}
        {'image': (2, 3, 32, 24), 'normal': (2, 3, 32, 24), 'mask': (2, 1, 32, 24)}
    """

    def __init__(
        self,
        batch_size: int = 1,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        batch_size = check_int("batch_size", batch_size, minimum=1)
        val_batch_size = check_optional_int("val_batch_size", val_batch_size, minimum=1)
        num_workers = check_int("num_workers", num_workers, minimum=0)
        pin_memory = check_bool("pin_memory", pin_memory)
        persistent_workers = check_bool("persistent_workers", persistent_workers)
        drop_last = check_bool("drop_last", drop_last)
        if persistent_workers and num_workers == 0:
            raise ValueError("`persistent_workers=True` needs worker processes; set `num_workers` > 0 or turn it off")
        self.batch_size = batch_size
        self.val_batch_size = batch_size if val_batch_size is None else val_batch_size
        self.pin_memory = pin_memory
        self.loader_options: dict[str, Any] = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "persistent_workers": persistent_workers,
        }
        self.drop_last = drop_last
        self._datasets: tuple[Dataset, Dataset | None] | None = None
        # Collects the arguments of every `__init__` up the subclass chain, not only these.
        self.save_hyperparameters()

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """Return the ``(train, val)`` datasets; ``val`` is None when there is no validation data."""
        raise NotImplementedError(f"{type(self).__name__} must implement `_build_datasets()`")

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets on the first call; later calls do nothing."""
        if self._datasets is None:
            self._datasets = self._build_datasets()

    @property
    def train_dataset(self) -> Dataset:
        """The training dataset; builds it if needed."""
        self.setup()
        assert self._datasets is not None
        return self._datasets[0]

    @property
    def val_dataset(self) -> Dataset | None:
        """The validation dataset, or None; builds it if needed."""
        self.setup()
        assert self._datasets is not None
        return self._datasets[1]

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches whose order is a function of the run's seed and the epoch, resumable mid-epoch.

        See :class:`~lightning_memopt.data.resumable.ResumableDataLoader`: Lightning saves its position
        in checkpoints, so a resumed run sees the batches the uninterrupted run would have seen.

        Raises:
            ValueError: ``drop_last`` is set and the training set is smaller than one batch.
        """
        dataset = self.train_dataset
        size = len(dataset)  # type: ignore[arg-type]
        if self.drop_last and size < self.batch_size:
            raise ValueError(
                f"the training set has {size} samples, fewer than `batch_size`={self.batch_size!r}, so"
                " `drop_last=True` would leave no batch; lower `batch_size` or set `drop_last=False`"
            )
        return ResumableDataLoader(dataset, batch_size=self.batch_size, drop_last=self.drop_last, **self.loader_options)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in order, or ``[]`` (no validation) when there is no validation data.

        Under DDP each rank evaluates every world-size-th sample, so metrics count each sample once.
        """
        dataset = self.val_dataset
        if dataset is None:
            return []
        return self.evaluation_loader(dataset)

    def evaluation_loader(self, dataset: Dataset) -> DataLoader:
        """Batches of ``dataset`` in order; under DDP each rank a share, each sample once (no padding).

        Under a sharded strategy (FSDP) the ranks run the same number of batches, a few samples repeated.
        The loader has its own generator: evaluating draws nothing from the global RNG, so training's random
        stream is the same whether or not (and however often) validation ran, as a resumed run needs.
        """
        strategy = getattr(self.trainer, "strategy", None)
        sharded = isinstance(strategy, FSDPStrategy | ModelParallelStrategy)  # (fsdp_memopt builds on the latter)
        sampler = evaluation_sampler(dataset, sharded_model=sharded)  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(run_seed())
        return DataLoader(
            dataset, batch_size=self.val_batch_size, sampler=sampler, generator=generator, **self.loader_options
        )


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
