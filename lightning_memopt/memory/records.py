"""What a memory tracker counts: categories and phases, one live storage, a snapshot of them, host allocations.

Example::

    >>> snapshot = MemorySnapshot(4096, "forward", [StorageRecord(4096, "activations", "encoder", "mm", (32, 32),
    ...                                                          torch.float32)])
    >>> snapshot.by_category()["activations"], snapshot.activations_by_module()
    (4096, {'encoder': 4096})
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lightning_memopt.private_api import is_traceable_wrapper_subclass

CATEGORIES = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
PHASES = ("setup", "forward", "backward", "optimizer")
CATEGORY_OF_PHASE = {  # what a storage made in each phase is, until relabelled
    "setup": "temporaries",
    "forward": "activations",
    "backward": "temporaries",
    "optimizer": "temporaries",
}


# the op of a storage that holds a parameter cast to another dtype (autocast's weight copies); an FSDP unit
# gathered in the compute dtype needs none
PARAMETER_CAST = "parameter cast"
# the op of a storage grown back in place (FSDP's gathered parameters, allocated again for each gather)
GATHERED_PARAMETERS = "gathered parameters"
_HOST_ALLOCATION = threading.local()


@contextmanager
def host_memory() -> Iterator[None]:
    """Storages made inside the block are host memory: a tracker counts them in ``host_bytes``, not ``live_bytes``.

    Example::

        >>> from lightning_memopt.memory.tracker import MemoryTracker
        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     device = torch.ones(256)
        ...     with host_memory():
        ...         host = torch.ones(512)
        >>> tracker.live_bytes, tracker.host_bytes, tracker.peak_host_bytes
        (1024, 2048, 2048)
    """
    previous = getattr(_HOST_ALLOCATION, "active", False)
    _HOST_ALLOCATION.active = True
    try:
        yield
    finally:
        _HOST_ALLOCATION.active = previous


def allocating_on_host() -> bool:
    """Whether the running code is inside :func:`host_memory` (an offload copy, not device work)."""
    return bool(getattr(_HOST_ALLOCATION, "active", False))


@dataclass
class StorageRecord:
    """One live storage: its size, what it is, and where it was made."""

    nbytes: int
    category: str
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: str = ""  # the innermost block (see MemoryTracker.track_blocks) whose forward made it


@dataclass
class BlockAccount:
    """What one block's forward left alive for the backward pass, by the op that made it (outputs excluded)."""

    saved_bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    calls: int = 0  # forward calls of the block in the step
    output_bytes: int = 0  # its outputs still alive (the next block saves them: offloading it moves them too)

    def bytes_made_by(self, ops: Iterable[str]) -> int:
        """The saved bytes that the named ops made (e.g. the matmuls selective checkpointing keeps)."""
        return sum(self.by_op.get(op, 0) for op in ops)


@dataclass
class MemorySnapshot:
    """The live storages at one moment (the peak), with their totals."""

    total_bytes: int = 0
    phase: str = "setup"
    records: list[StorageRecord] = field(default_factory=list)

    def by_category(self) -> dict[str, int]:
        """Bytes per category, every category present (zeros included)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for record in self.records:
            totals[record.category] += record.nbytes
        return totals

    def activations_by_module(self) -> dict[str, int]:
        """Activation bytes per top-level module, largest first."""
        totals: dict[str, int] = defaultdict(int)
        for record in self.records:
            if record.category == "activations":
                totals[record.module or "<root>"] += record.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def activations_by_block(self) -> dict[str, int]:
        """Activation bytes per tracked block (:meth:`MemoryTracker.track_blocks`: the declared or discovered blocks,
        wherever they sit, a ``ModuleList``'s too), largest first; none when no block was tracked."""
        totals: dict[str, int] = defaultdict(int)
        for record in self.records:
            if record.category == "activations" and record.block:
                totals[record.block] += record.nbytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def largest(self, count: int = 10) -> list[StorageRecord]:
        """The ``count`` largest storages."""
        return sorted(self.records, key=lambda record: -record.nbytes)[:count]


def storages(tensor: torch.Tensor) -> Iterator[tuple[torch.UntypedStorage, torch.Tensor]]:
    """The storages a tensor holds, each with the (local) tensor viewing it: a wrapper subclass's are its inner ones."""
    if is_traceable_wrapper_subclass(tensor):
        attributes, _ = tensor.__tensor_flatten__()  # DTensor: its local shard
        for inner in (getattr(tensor, name) for name in attributes):
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    else:
        yield tensor.untyped_storage(), tensor
