"""Training batches that resume mid-epoch: order a function of (seed, epoch), position saved in checkpoints.

Lightning saves the ``state_dict()`` of a training loader that has one and hands it back to
``load_state_dict()`` on resume (before the first batch); the loader then yields the rest of the
epoch while keeping its full length, as Lightning expects. :class:`ResumableDataLoader` is such a
loader over a :class:`ResumableSampler`, a ``DistributedSampler`` (so Lightning keeps it under DDP /
FSDP instead of inserting its own) whose permutation depends on ``(seed, epoch)`` only.

Datasets whose samples are random (augmentation) get the epoch with the index: a dataset with
``takes_epoch_keys = True`` receives :class:`EpochIndex` keys and seeds its randomness from
:func:`sample_generator`, so a sample is the same whichever worker loads it and wherever the run resumed.
The synthetic datasets are :class:`SeededDataset` draws: item ``i`` comes from ``(seed, first + i)`` alone, and
validation from a later range (:func:`disjoint_ranges`).
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
from collections.abc import Callable, Iterator, Sized
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_memopt.arguments import check_int


class EpochIndex(NamedTuple):
    """The key a ``takes_epoch_keys`` dataset receives: which sample, in which epoch."""

    epoch: int
    index: int


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator seeded by ``(seed, epoch, index)`` alone: a sample's own random stream.

    Example::

        >>> a = torch.rand(2, generator=sample_generator(0, 1, 5))
        >>> torch.equal(a, torch.rand(2, generator=sample_generator(0, 1, 5)))
        True
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def run_seed() -> int:
    """The seed of the data order: ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0 — the same on every rank."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class ResumableSampler(DistributedSampler):
    """Each rank's share of a permutation drawn from ``seed + epoch``, started part-way after a resume.

    Without a process group it is the whole dataset on one rank. ``resume(epoch, start)`` makes the
    next pass over that epoch skip its first ``start`` indices; a pass over another epoch drops it.

    Example::

        >>> sampler = ResumableSampler(range(6), shuffle=False)
        >>> sampler.resume(epoch=0, start=4)
        >>> list(sampler), list(sampler)
        ([4, 5], [0, 1, 2, 3, 4, 5])
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int | None = None, epoch_keys: bool = False) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=dist.get_world_size() if distributed else 1,
            rank=dist.get_rank() if distributed else 0,
            shuffle=shuffle,
            seed=run_seed() if seed is None else seed,
        )
        self.epoch_keys = epoch_keys
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, start: int) -> None:
        """Set the epoch and skip the first ``start`` indices of its next pass."""
        self.set_epoch(epoch)
        self._resume = (epoch, start)

    def pending_start(self) -> int:
        """The indices the next pass will skip: those of :meth:`resume` for this epoch, else 0."""
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0

    def __iter__(self) -> Iterator[Any]:
        start = self.pending_start()
        self._resume = None
        indices = list(super().__iter__())[start:]
        if self.epoch_keys:
            return iter([EpochIndex(self.epoch, index) for index in indices])
        return iter(indices)


class ResumableDataLoader(DataLoader):
    """A shuffled training ``DataLoader`` whose position Lightning saves and restores mid-epoch.

    The order is a function of ``(seed, epoch)`` (``seed``: ``seed_everything``'s by default), worker
    seeds of ``(seed, epoch)`` too, so neither touches the global RNG. ``state_dict()`` holds the
    epoch and the samples each rank has consumed; a checkpoint resumed with another batch size or
    world size keeps the position in samples (with a warning: the order then differs from the
    uninterrupted run's).

    Runs without a seed (no ``seed_everything``) shuffle alike, with seed 0, as Lightning's own
    distributed sampler does. A ``sampler`` or ``batch_sampler`` given (Lightning's, for
    ``overfit_batches``) replaces the resumable order.

    Args:
        dataset: a sized map-style dataset; one with ``takes_epoch_keys = True`` gets :class:`EpochIndex` keys.
        batch_size: samples per batch.
        shuffle: permute every epoch (``False``: in order).
        seed: seed of the order; ``None`` means ``PL_GLOBAL_SEED`` (set by ``seed_everything``) or 0.
        drop_last: drop the last incomplete batch.
        sampler: another sampler instead of the resumable one (the loader is then not resumable).
        batch_sampler: another batch sampler instead (likewise).
        **options: further ``DataLoader`` arguments (``num_workers``, ``pin_memory``, …).

    Example::

        >>> loader = ResumableDataLoader(range(8), batch_size=2, seed=0)
        >>> batches = iter(loader)
        >>> first = [next(batches).tolist() for _ in range(2)]
        >>> state = loader.state_dict()
        >>> resumed = ResumableDataLoader(range(8), batch_size=2, seed=0)
        >>> resumed.load_state_dict(state)
        >>> [batch.tolist() for batch in resumed] == [batch.tolist() for batch in list(iter(loader))[2:]]
        True
        >>> len(resumed)
        4
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int | None = 1,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        sampler: Any = None,
        batch_sampler: Any = None,
        **options: Any,
    ) -> None:
        if sampler is None and batch_sampler is None:
            sampler = ResumableSampler(
                dataset,  # type: ignore[arg-type]
                shuffle=shuffle,
                seed=seed,
                epoch_keys=getattr(dataset, "takes_epoch_keys", False),
            )
            options["generator"] = torch.Generator()
        # else Lightning rebuilt the loader with a sampler of its own (`overfit_batches`): not resumable
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler, batch_sampler=batch_sampler, drop_last=drop_last, **options
        )
        self._consumed = 0  # samples this rank consumed in the current epoch

    @property
    def resumable(self) -> bool:
        """Whether the loader runs on its own :class:`ResumableSampler` (not on a sampler Lightning put in)."""
        return isinstance(self.sampler, ResumableSampler)

    def __iter__(self) -> Iterator[Any]:
        if not self.resumable:
            return super().__iter__()
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        self.generator.manual_seed(sampler.seed + sampler.epoch)  # type: ignore[union-attr]
        self._consumed = sampler.pending_start()
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._consumed += self.batch_size  # type: ignore[operator]
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the samples this rank consumed in it, and the layout they were counted in (``{}`` when not
        :attr:`resumable`)."""
        if not self.resumable:
            return {}
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        consumed = min(self._consumed, self._epoch_samples())
        return {"epoch": sampler.epoch, "consumed": consumed, "world_size": sampler.num_replicas, "seed": sampler.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass over its epoch skips the samples consumed; after a whole
        epoch, the next pass is the next epoch's, from its start."""
        if not self.resumable or not state:
            return
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if state.get("world_size", sampler.num_replicas) != sampler.num_replicas or state.get("seed") != sampler.seed:
            rank_zero_warn(
                f"Resuming the training data on {sampler.num_replicas} rank(s) with seed {sampler.seed} from a"
                f" checkpoint of {state.get('world_size')} rank(s) with seed {state.get('seed')}: the epoch continues"
                " after the same share of its samples, in another order than the uninterrupted run's."
            )
            consumed = math.ceil(consumed * state.get("world_size", 1) / sampler.num_replicas)
        if consumed >= self._epoch_samples():
            epoch, consumed = epoch + 1, 0
        sampler.resume(epoch, consumed)
        self._consumed = consumed

    def _epoch_samples(self) -> int:
        """The samples this rank consumes in a whole epoch (its batches times the batch size, at most its share)."""
        return min(self.sampler.num_samples, len(self) * self.batch_size)  # type: ignore[attr-defined,operator]


D = TypeVar("D", bound=Dataset)


class SeededDataset(Dataset):
    """Base of the synthetic datasets: ``length`` items, item ``i`` drawn when read by :meth:`draw` from a NumPy
    generator seeded with ``(seed, first + i)``.

    Args:
        length: number of items, at least 0.
        seed: seed of the whole dataset, at least 0.
        first: number of the first item, at least 0, so that datasets of non-overlapping ranges (train
            and validation) hold different draws.
        unit: what the items are called in messages (``"samples"``, ``"clips"``).

    Raises:
        ValueError: a number out of range.
        TypeError: a number that is no integer.

    Example::

        >>> class Numbers(SeededDataset):
        ...     def draw(self, rng, number):
        ...         return number
        >>> list(Numbers(3, seed=0, first=10)), len(Numbers(3, seed=0))
        ([10, 11, 12], 3)
    """

    def __init__(self, length: int, seed: int, first: int = 0, unit: str = "samples") -> None:
        self.length = check_int("length", length, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)
        self.first = check_int("first", first, minimum=0)
        self.unit = unit

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= operator.index(index) < self.length:
            raise IndexError(f"index {index!r} out of range for a dataset of {self.length} {self.unit}")
        number = self.first + operator.index(index)
        return self.draw(np.random.default_rng([self.seed, number]), number)

    def draw(self, rng: np.random.Generator, number: int) -> Any:
        """Item number ``number`` (``first + index``), every random choice taken from ``rng``."""
        raise NotImplementedError(f"{type(self).__name__} must implement `draw()`")


def disjoint_ranges(make: Callable[[int, int], D], train_count: int, val_count: int) -> tuple[D, D | None]:
    """``(train, val)``: ``make(count, first)`` of the draws ``0 … train_count − 1`` and of the ``val_count`` after
    them; ``val`` is None when ``val_count`` is 0.

    Example::

        >>> draws = lambda count, first: range(first, first + count)
        >>> disjoint_ranges(draws, 3, 2), disjoint_ranges(draws, 3, 0)
        ((range(0, 3), range(3, 5)), (range(0, 3), None))
    """
    return make(train_count, 0), make(val_count, train_count) if val_count else None
