"""MemoryTracker: count live tensor-storage bytes by category, at dispatch level.

Works on any device and under ``FakeTensorMode`` (where nothing is allocated but every storage
still has a size), so the same accounting measures a CPU step, a CUDA step, or a step that was
never run. Storages are counted once (views share them) and leave the count when they die.
Storages made inside :func:`host_memory` (activations offloaded to the host) are counted apart,
as ``host_bytes``: they are not device memory.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
PHASES = ("setup", "forward", "backward", "optimizer")
_CATEGORY_OF_PHASE = {
    "setup": "temporaries",
    "forward": "activations",
    "backward": "temporaries",
    "optimizer": "temporaries",
}


_HOST_ALLOCATION = threading.local()


@contextmanager
def host_memory() -> Iterator[None]:
    """Storages made inside the block are host memory: a tracker counts them in ``host_bytes``, not ``live_bytes``.

    Example::

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

    def largest(self, count: int = 10) -> list[StorageRecord]:
        """The ``count`` largest storages."""
        return sorted(self.records, key=lambda record: -record.nbytes)[:count]


class MemoryTracker(TorchDispatchMode):
    """A dispatch mode that counts live storage bytes by category and remembers the peak.

    New storages are labelled by the current phase (``forward`` → activations, others →
    temporaries); :meth:`track` labels existing tensors (parameters, inputs), and
    :meth:`relabel` turns temporaries into gradients or optimizer state once they are known.

    Args:
        round_to: round every storage up to a multiple of this many bytes (512 mimics the CUDA
            caching allocator's block size); 1 counts exact bytes.
        record_timeline: keep ``(event, live bytes, phase)`` for every allocation and free.

    Example::

        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     a = torch.ones(256)          # 1 KiB
        ...     b = a * 2                    # another KiB
        ...     del a
        >>> tracker.live_bytes, tracker.peak.total_bytes
        (1024, 2048)
    """

    def __init__(self, round_to: int = 1, record_timeline: bool = False) -> None:
        super().__init__()
        if round_to < 1:
            raise ValueError(f"`round_to`={round_to!r} must be at least 1")
        self.round_to = round_to
        self.phase = "setup"
        self.live_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._host_records: dict[int, int] = {}
        self._peak = MemorySnapshot()
        self.phase_peaks: dict[str, int] = {}  # the most live bytes seen in each phase
        self._peak_pending = False  # a new peak whose records are still exactly the live ones
        self.timeline: list[tuple[int, int, str]] | None = [] if record_timeline else None
        self._records: dict[int, StorageRecord] = {}
        self._module_stack: list[str] = []
        self._block_stack: list[str] = []
        self._block_outputs: dict[str, set[int]] = {}  # block -> storage keys of its latest outputs
        self._block_calls: dict[str, int] = {}
        self._hooks: list[Any] = []
        self._lock = threading.RLock()
        self._events = 0

    # -- what gets counted -------------------------------------------------------------------
    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def _add(self, tensor: torch.Tensor, category: str, op: str) -> StorageRecord | None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if allocating_on_host():
            self._add_host(storage, key)
            return None
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                return None
            nbytes = self._rounded(storage.nbytes())
            self._before_allocation(nbytes, op, tuple(tensor.shape), tensor.dtype)
            record = StorageRecord(
                nbytes, category, self._current_module(), op, tuple(tensor.shape), tensor.dtype, self.current_block
            )
            self._records[key] = record
            self.live_bytes += nbytes
            if self.live_bytes > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.live_bytes
            weakref.finalize(storage, self._remove, key)
            self._after_change()
            if self.live_bytes > self._peak.total_bytes:
                # copying the live records at every new peak would be quadratic in a growing forward pass:
                # remember the peak now, copy its records only when memory first falls from it
                self._peak = MemorySnapshot(self.live_bytes, self.phase)
                self._peak_pending = True
            return record

    def _add_host(self, storage: torch.UntypedStorage, key: int) -> None:
        with self._lock:
            if key in self._host_records or key in self._records:
                return
            nbytes = self._rounded(storage.nbytes())
            self._host_records[key] = nbytes
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            weakref.finalize(storage, self._remove_host, key)

    def _remove_host(self, key: int) -> None:
        with self._lock:
            self.host_bytes -= self._host_records.pop(key, 0)

    def _remove(self, key: int) -> None:
        with self._lock:
            if self._peak_pending and key in self._records:
                self._peak.records = list(self._records.values())
                self._peak_pending = False
            record = self._records.pop(key, None)
            if record is not None:
                self.live_bytes -= record.nbytes
                self._after_change()

    def _after_change(self) -> None:
        self._events += 1
        if self.timeline is not None:
            self.timeline.append((self._events, self.live_bytes, self.phase))

    def _before_allocation(self, nbytes: int, op: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Hook for subclasses (a budget check); called before a new storage is counted."""

    def track(self, tensors: Iterable[torch.Tensor | None], category: str, op: str = "tracked") -> None:
        """Count existing tensors under ``category`` (or relabel them if already counted)."""
        if category not in CATEGORIES:
            raise ValueError(f"Unknown `category`={category!r}; valid choices: {', '.join(CATEGORIES)}")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and self._add(tensor, category, op) is None:
                self.relabel([tensor], category)

    def relabel(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Give the storages of counted ``tensors`` a new category (gradients, optimizer state)."""
        with self._lock:
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    record = self._records.get(id(tensor.untyped_storage()))
                    if record is not None:
                        record.category = category

    def track_module(self, module: nn.Module) -> None:
        """Count ``module``'s parameters, buffers and gradients; attribute new storages to its top-level children."""
        self.track(module.parameters(), "parameters", op="parameter")
        self.track(module.buffers(), "parameters", op="buffer")
        self.track((p.grad for p in module.parameters()), "gradients", op="gradient")
        for name, child in module.named_children():
            self._hooks.append(child.register_forward_pre_hook(self._enter_module(name)))
            self._hooks.append(child.register_forward_hook(self._leave_module))

    def track_training_state(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any) -> None:
        """Count what a training step starts with: ``module`` (as :meth:`track_module`), optimizer state, batch."""
        self.track_module(module)
        for optimizer in optimizers:
            self.track_optimizer(optimizer)
        self.track(tree_flatten(batch)[0], "inputs", op="batch")

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the tensors already in ``optimizer.state`` as optimizer state."""
        self.track(_state_tensors(optimizer), "optimizer_state", op="optimizer state")

    def relabel_gradients(self, module: nn.Module) -> None:
        """Mark the current ``.grad`` of every parameter of ``module`` as gradients."""
        self.relabel((p.grad for p in module.parameters()), "gradients")

    def relabel_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark every tensor in ``optimizer.state`` as optimizer state."""
        self.relabel(_state_tensors(optimizer), "optimizer_state")

    def track_blocks(self, model: nn.Module, names: Iterable[str]) -> None:
        """Attribute new storages to the named submodules of ``model`` (the innermost one that is running).

        :meth:`block_accounts` then tells what each block's forward left alive for the backward
        pass: what checkpointing that block would free.
        """
        modules = dict(model.named_modules())
        for name in names:
            module = modules[name]
            self._hooks.append(module.register_forward_pre_hook(self._enter_block(name)))
            self._hooks.append(module.register_forward_hook(self._leave_block(name)))

    def _enter_block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._block_stack.append(name)
            self._block_calls[name] = self._block_calls.get(name, 0) + 1

        return hook

    def _leave_block(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._block_stack:
                self._block_stack.pop()
            outputs = (t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
            self._block_outputs[name] = {id(t.untyped_storage()) for t in outputs}

        return hook

    def block_accounts(self) -> dict[str, BlockAccount]:
        """Live activation bytes per tracked block, outputs excluded (call it between forward and backward)."""
        accounts = {name: BlockAccount(calls=calls) for name, calls in self._block_calls.items()}
        with self._lock:
            for key, record in self._records.items():
                if not record.block or record.category != "activations":
                    continue
                account = accounts[record.block]  # its pre-hook counted the call that made the record
                if key in self._block_outputs.get(record.block, ()):
                    account.output_bytes += record.nbytes
                    continue
                account.saved_bytes += record.nbytes
                account.by_op[record.op] = account.by_op.get(record.op, 0) + record.nbytes
        return accounts

    @property
    def current_block(self) -> str:
        """The innermost tracked block running now, or ``""``."""
        return self._block_stack[-1] if self._block_stack else ""

    def _enter_module(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._module_stack.append(name)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def _current_module(self) -> str:
        return self._module_stack[0] if self._module_stack else ""

    def remove_hooks(self) -> None:
        """Detach the module hooks added by :meth:`track_module`."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- phases and peaks --------------------------------------------------------------------
    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Label what is allocated inside the block with ``phase`` (forward, backward, optimizer)."""
        if phase not in PHASES:
            raise ValueError(f"Unknown `phase`={phase!r}; valid choices: {', '.join(PHASES)}")
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    @property
    def peak(self) -> MemorySnapshot:
        """The live storages at the highest count so far (since :meth:`reset_peak`)."""
        with self._lock:
            if self._peak_pending:
                self._peak.records = list(self._records.values())
                self._peak_pending = False
            return self._peak

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        with self._lock:
            self._peak = MemorySnapshot(self.live_bytes, self.phase, list(self._records.values()))
            self._peak_pending = False
            self.phase_peaks = {}
            self.peak_host_bytes = self.host_bytes
            if self.timeline is not None:
                self.timeline.clear()

    def current(self) -> MemorySnapshot:
        """The storages live now."""
        with self._lock:
            return MemorySnapshot(self.live_bytes, self.phase, list(self._records.values()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE_QUERY:
            return out
        category = _CATEGORY_OF_PHASE[self.phase]
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, category, str(func.overloadpacket.__name__))
        return out


# `tensor.device` of a fake tensor reaches the modes as this op (autocast and autograd ask often): no storage
_DEVICE_QUERY = torch.ops.prim.device.default


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
