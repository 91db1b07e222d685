"""MemoryTracker: count live tensor-storage bytes by category, at dispatch level.

Works on any device and under ``FakeTensorMode`` (where nothing is allocated but every storage
still has a size), so the same accounting measures a CPU step, a CUDA step, or a step that was
never run. Storages are counted once (views share them) and leave the count when they die.
Storages made inside :func:`host_memory` (activations offloaded to the host) are counted apart,
as ``host_bytes``: they are not device memory.

Over 500 lines because counting, labelling and the peaks share one record table under one lock;
what is counted lives in ``records.py``, who made it in ``attribution.py``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.attribution import ModuleAttribution
from lightning_memopt.memory.records import (
    CATEGORIES,
    CATEGORY_OF_PHASE,
    GATHERED_PARAMETERS,
    PARAMETER_CAST,
    PHASES,
    BlockAccount,
    MemorySnapshot,
    StorageRecord,
    allocating_on_host,
    host_memory,
    storages,
)
from lightning_memopt.memory.workspace import CONVOLUTION_OPS, MATMUL_OPS, LibraryWorkspace
from lightning_memopt.private_api import CAST_OP, TorchDispatchMode, tree_flatten

__all__ = [  # (the records are re-exported: what a tracker returns)
    "CATEGORIES",
    "GATHERED_PARAMETERS",
    "PARAMETER_CAST",
    "PHASES",
    "BlockAccount",
    "MemorySnapshot",
    "MemoryTracker",
    "StorageRecord",
    "allocating_on_host",
    "host_memory",
    "tracking",
]


class MemoryTracker(TorchDispatchMode):
    """A dispatch mode that counts live storage bytes by category and remembers the peak.

    New storages are labelled by the current phase (``forward`` → activations, others →
    temporaries); :meth:`track` labels existing tensors (parameters, inputs), and
    :meth:`relabel` turns temporaries into gradients or optimizer state once they are known.
    A copy of a parameter in another dtype (autocast's weight casts) is made by op
    :data:`PARAMETER_CAST`.

    Sharded training (FSDP2) is counted as a rank holds it: a tensor subclass that wraps local
    tensors (``DTensor``: sharded parameters, their gradients and optimizer state) counts the
    storages of its local tensors; a storage resized in place (``UntypedStorage.resize_``, how FSDP
    frees a unit's gathered parameters after use and allocates them again for the next gather)
    counts at its current size, and once grown back, as ``parameters``. Storages made inside
    :func:`host_memory`, or tracked with ``host=True`` (CPU-offloaded parameter shards), are host
    memory: ``host_bytes``, not ``live_bytes``; the gradients and optimizer state of host
    parameters join them at :meth:`relabel_gradients` / :meth:`relabel_optimizer_state`.

    Args:
        round_to: round every storage up to a multiple of this many bytes (512 mimics the CUDA
            caching allocator's block size); 1 counts exact bytes.
        record_timeline: keep ``(event, live bytes, phase)`` for every allocation and free.
        workspace: count the library workspaces a CUDA step holds beside its tensors (see
            :mod:`lightning_memopt.memory.workspace`), as ``temporaries`` of op ``cublas workspace``
            (kept) and ``cudnn workspace`` (during each convolution); ``None`` counts tensors only.
        host_is_device: the step runs on the host (a CPU device): what is offloaded to the host stays in
            the same memory, so it counts in ``live_bytes`` like any storage (``host_bytes`` stays 0).

    Example::

        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     a = torch.ones(256)          # 1 KiB
        ...     b = a * 2                    # another KiB
        ...     del a
        >>> tracker.live_bytes, tracker.peak.total_bytes
        (1024, 2048)
    """

    def __init__(
        self,
        round_to: int = 1,
        record_timeline: bool = False,
        workspace: LibraryWorkspace | None = None,
        host_is_device: bool = False,
    ) -> None:
        super().__init__()
        if round_to < 1:
            raise ValueError(f"`round_to`={round_to!r} must be at least 1")
        self.round_to = round_to
        self.workspace = workspace
        self.host_is_device = host_is_device
        self._cublas_phases: set[str] = set()  # the phases whose thread has its cuBLAS workspace
        self.phase = "setup"
        self.live_bytes = 0
        self.gradient_bytes = 0  # of live_bytes: those labelled gradients now
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._host_records: dict[int, StorageRecord] = {}
        self._peak = MemorySnapshot()
        self._phase_peaks: dict[str, MemorySnapshot] = {}  # the most live bytes seen in each phase
        # the most live bytes other than gradients in each phase (what sharded gradients leave), at that moment
        self._lean_peaks: dict[str, tuple[int, MemorySnapshot]] = {}
        self._pending: list[MemorySnapshot] = []  # peaks whose records are still exactly the live ones
        self.timeline: list[tuple[int, int, str]] | None = [] if record_timeline else None
        self._records: dict[int, StorageRecord] = {}
        self.attribution = ModuleAttribution()
        self._lock = threading.RLock()
        self._events = 0
        self.active = False  # the dispatch mode is entered (counting)

    # -- what gets counted -------------------------------------------------------------------
    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def _add(self, tensor: torch.Tensor, category: str, op: str, host: bool = False) -> bool:
        """Count the storages of ``tensor`` not counted yet; whether it had any."""
        added = False
        for storage, local in storages(tensor):
            key = id(storage)
            if (host or allocating_on_host()) and not self.host_is_device:
                added |= self._add_host(
                    storage, key, StorageRecord(0, category, "", op, tuple(local.shape), local.dtype)
                )
                continue
            with self._lock:
                if key in self._records or key in self._host_records:
                    continue
                nbytes = self._rounded(storage.nbytes())
                record = StorageRecord(
                    nbytes,
                    category,
                    self.attribution.current_module,
                    op,
                    tuple(local.shape),
                    local.dtype,
                    self.current_block,
                )
                self._grow(nbytes, record)
                self._records[key] = record
                weakref.finalize(storage, self._remove, key)
                added = True
        return added

    def _grow(self, nbytes: int, record: StorageRecord) -> None:
        """Count ``nbytes`` more for ``record`` (new or grown); a new overall or phase peak remembers the records."""
        self._before_allocation(nbytes, record.op, record.shape, record.dtype)
        self.live_bytes += nbytes
        self.gradient_bytes += nbytes if record.category == "gradients" else 0
        lean = self.live_bytes - self.gradient_bytes
        phase_peak, lean_peak = self._phase_peaks.get(self.phase), self._lean_peaks.get(self.phase)
        fresh = {
            "peak": self.live_bytes > self._peak.total_bytes,
            "phase": phase_peak is None or self.live_bytes > phase_peak.total_bytes,
            "lean": lean_peak is None or lean > lean_peak[0],
        }
        renewed = {id(self._peak)} if fresh["peak"] else set()
        renewed |= {id(phase_peak)} if fresh["phase"] and phase_peak is not None else set()
        renewed |= {id(lean_peak[1])} if fresh["lean"] and lean_peak is not None else set()
        # the live records are about to change: the peaks kept from before take their records now (copying them
        # at every new peak would be quadratic in a growing forward pass)
        self._settle([snapshot for snapshot in self._pending if id(snapshot) not in renewed])
        self._pending = []  # those left are renewed now
        if fresh["peak"]:
            self._peak = MemorySnapshot(self.live_bytes, self.phase)
            self._pending.append(self._peak)
        if fresh["phase"]:
            self._phase_peaks[self.phase] = MemorySnapshot(self.live_bytes, self.phase)
            self._pending.append(self._phase_peaks[self.phase])
        if fresh["lean"]:
            self._lean_peaks[self.phase] = (lean, MemorySnapshot(self.live_bytes, self.phase))
            self._pending.append(self._lean_peaks[self.phase][1])
        self._after_change()

    def _drop(self, record: StorageRecord, nbytes: int) -> None:
        """Count ``nbytes`` fewer of ``record`` (freed, shrunk or moved to the host)."""
        self.live_bytes -= nbytes
        self.gradient_bytes -= nbytes if record.category == "gradients" else 0
        self._after_change()

    def _settle(self, snapshots: list[MemorySnapshot] | None = None) -> None:
        """Give the pending peaks (or ``snapshots`` of them) the live records, and stop them pending."""
        snapshots = self._pending if snapshots is None else snapshots
        if snapshots:
            records = list(self._records.values())
            for snapshot in snapshots:
                snapshot.records = records
        self._pending = [snapshot for snapshot in self._pending if not any(snapshot is s for s in snapshots)]

    def _add_host(self, storage: torch.UntypedStorage, key: int, record: StorageRecord) -> bool:
        with self._lock:
            if key in self._host_records:
                return False
            if key in self._records:  # counted on the device: it moves to the host
                self._settle()
                moved = self._records.pop(key)
                self._drop(moved, moved.nbytes)
            else:
                weakref.finalize(storage, self._remove_host, key)
            record.nbytes = self._rounded(storage.nbytes())
            self._host_records[key] = record
            self.host_bytes += record.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            return True

    def _remove_host(self, key: int) -> None:
        with self._lock:
            record = self._host_records.pop(key, None)
            self.host_bytes -= record.nbytes if record is not None else 0

    def _remove(self, key: int) -> None:
        with self._lock:
            if key not in self._records:
                return
            self._settle()
            record = self._records.pop(key)
            self._drop(record, record.nbytes)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place: count its new size (grown back: gathered parameters)."""
        key = id(storage)
        with self._lock:
            nbytes = self._rounded(storage.nbytes())
            host = self._host_records.get(key)
            if host is not None:
                self.host_bytes += nbytes - host.nbytes
                self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
                host.nbytes = nbytes
                return
            record = self._records.get(key)
            if record is None or nbytes == record.nbytes:
                return
            # a new record: the peaks that hold the old one keep its size then
            self._settle()
            self._drop(record, record.nbytes)
            if nbytes == 0:
                self._records[key] = replace(record, nbytes=0)
                return
            self._records[key] = replace(record, nbytes=nbytes, category="parameters", op=GATHERED_PARAMETERS)
            self._grow(nbytes, self._records[key])

    def _after_change(self) -> None:
        self._events += 1
        if self.timeline is not None:
            self.timeline.append((self._events, self.live_bytes, self.phase))

    def _before_allocation(self, nbytes: int, op: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Hook for subclasses (a budget check); called before a new storage is counted."""

    def track(
        self, tensors: Iterable[torch.Tensor | None], category: str, op: str = "tracked", host: bool = False
    ) -> None:
        """Count existing tensors under ``category`` (or relabel them if already counted); ``host``: as host memory."""
        if category not in CATEGORIES:
            raise ValueError(f"Unknown `category`={category!r}; valid choices: {', '.join(CATEGORIES)}")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and not self._add(tensor, category, op, host):
                self.relabel([tensor], category)

    def relabel(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Give the storages of counted ``tensors`` a new category (gradients, optimizer state)."""
        with self._lock:
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    for storage, _ in storages(tensor):
                        record = self._records.get(id(storage))
                        if record is not None:
                            was, now = record.category == "gradients", category == "gradients"
                            self.gradient_bytes += record.nbytes * (now - was)
                        record = record or self._host_records.get(id(storage))
                        if record is not None:
                            record.category = category

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storages are counted as host memory."""
        return any(id(storage) in self._host_records for storage, _ in storages(tensor))

    def track_module(self, module: nn.Module) -> None:
        """Count ``module``'s parameters, buffers and gradients; attribute new storages to its top-level children."""
        self.track(module.parameters(), "parameters", op="parameter")
        self.track(module.buffers(), "parameters", op="buffer")
        self.track((p.grad for p in module.parameters()), "gradients", op="gradient")
        self.attribution.track_children(module)

    def track_training_state(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any) -> None:
        """Count what a training step starts with: ``module`` (as :meth:`track_module`), optimizer state, batch."""
        self.track_module(module)
        for optimizer in optimizers:
            self.track_optimizer(optimizer)
        self.track(tree_flatten(batch)[0], "inputs", op="batch")

    @classmethod
    def start_training_step(
        cls, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any, record_timeline: bool = False
    ) -> MemoryTracker:
        """A tracker that has counted what a training step starts with, counting now in its forward phase.

        What the callbacks run through one training step; end it with :meth:`close`.

        Example::

            >>> model = nn.Linear(4, 2)
            >>> tracker = MemoryTracker.start_training_step(model, [], torch.zeros(3, 4))
            >>> model(torch.zeros(3, 4)).sum().backward()
            >>> tracker.close()
            >>> tracker.active, tracker.peak.by_category()["parameters"]
            (False, 40)
        """
        from lightning_memopt.models.structure import model_structure  # models build on memory: imported here

        tracker = cls(record_timeline=record_timeline)
        tracker.track_training_state(module, optimizers, batch)
        tracker.track_blocks(module, model_structure(module).block_names)  # the report's blocks, wherever they sit
        tracker.phase = "forward"
        tracker.__enter__()
        return tracker

    def close(self) -> None:
        """Stop counting and detach the module hooks (the figures stay readable)."""
        if self.active:
            self.__exit__(None, None, None)
        self.remove_hooks()

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the tensors already in ``optimizer.state`` as optimizer state."""
        self.track(_state_tensors(optimizer), "optimizer_state", op="optimizer state")

    def relabel_gradients(self, module: nn.Module) -> None:
        """Mark the current ``.grad`` of every parameter of ``module`` as gradients (host ones for host parameters)."""
        for parameter in module.parameters():
            self._follow(parameter, [parameter.grad], "gradients")

    def relabel_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark every tensor in ``optimizer.state`` as optimizer state (host state for host parameters)."""
        for parameter, state in optimizer.state.items():
            self._follow(parameter, [v for v in state.values() if isinstance(v, torch.Tensor)], "optimizer_state")

    def _follow(self, parameter: torch.Tensor, tensors: list[torch.Tensor | None], category: str) -> None:
        if self.on_host(parameter):
            self.track(tensors, category, op=category.replace("_", " "), host=True)
        else:
            self.relabel(tensors, category)

    def track_blocks(self, model: nn.Module, names: Iterable[str]) -> None:
        """Attribute new storages to the named submodules of ``model`` (the innermost one that is running).

        :meth:`block_accounts` then tells what each block's forward left alive for the backward
        pass: what checkpointing that block would free.
        """
        self.attribution.track_blocks(model, names)

    def block_accounts(self) -> dict[str, BlockAccount]:
        """Live activation bytes per tracked block, outputs excluded (call it between forward and backward)."""
        accounts = {name: BlockAccount(calls=calls) for name, calls in self.attribution.calls.items()}
        with self._lock:
            for key, record in self._records.items():
                if not record.block or record.category != "activations":
                    continue
                account = accounts[record.block]  # its pre-hook counted the call that made the record
                if key in self.attribution.outputs.get(record.block, ()):
                    account.output_bytes += record.nbytes
                    continue
                account.saved_bytes += record.nbytes
                account.by_op[record.op] = account.by_op.get(record.op, 0) + record.nbytes
        return accounts

    @property
    def current_block(self) -> str:
        """The innermost tracked block running now, or ``""``."""
        return self.attribution.current_block

    def remove_hooks(self) -> None:
        """Detach the module hooks added by :meth:`track_module`, :meth:`track_blocks` and others."""
        self.attribution.remove_hooks()

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
            self._settle()
            return self._peak

    @property
    def phase_peaks(self) -> dict[str, int]:
        """The most live bytes seen in each phase (since :meth:`reset_peak`)."""
        return {phase: snapshot.total_bytes for phase, snapshot in self._phase_peaks.items()}

    def phase_peak(self, phase: str, less_gradients: bool = False) -> MemorySnapshot:
        """The live storages at the highest count in ``phase`` (empty if nothing was allocated in it).

        ``less_gradients``: at the highest count of bytes other than gradients instead (gradients
        labelled as they arrive, see :meth:`label_gradients_on_arrival`): the moment that matters
        when the gradients are sharded.
        """
        with self._lock:
            self._settle()
            if less_gradients:
                return self._lean_peaks.get(phase, (0, MemorySnapshot(0, phase)))[1]
            return self._phase_peaks.get(phase, MemorySnapshot(0, phase))

    def label_gradients_on_arrival(self, module: nn.Module) -> None:
        """Label each gradient of ``module``'s parameters as such when autograd accumulates it, not at
        :meth:`relabel_gradients` after the backward pass (hooks removed with :meth:`remove_hooks`)."""
        for parameter in module.parameters():
            if parameter.requires_grad:
                hook = parameter.register_post_accumulate_grad_hook(lambda p: self.relabel([p.grad], "gradients"))
                self.attribution.hooks.append(hook)

    def host_breakdown(self) -> dict[str, int]:
        """Host bytes live now, per category."""
        with self._lock:
            return MemorySnapshot(self.host_bytes, self.phase, list(self._host_records.values())).by_category()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        with self._lock:
            self._peak = MemorySnapshot(self.live_bytes, self.phase, list(self._records.values()))
            self._pending = []
            self._phase_peaks = {}
            self._lean_peaks = {}
            self.peak_host_bytes = self.host_bytes
            if self.timeline is not None:
                self.timeline.clear()

    def current(self) -> MemorySnapshot:
        """The storages live now."""
        with self._lock:
            return MemorySnapshot(self.live_bytes, self.phase, list(self._records.values()))

    def __enter__(self) -> MemoryTracker:
        self.active = True
        _RESIZE_WATCHERS.append(self)
        if len(_RESIZE_WATCHERS) == 1:
            torch.UntypedStorage.resize_ = _counted_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)
        _RESIZE_WATCHERS.remove(self)
        if not _RESIZE_WATCHERS:
            del torch.UntypedStorage.resize_  # back to torch's own (defined on its base class)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _DEVICE_QUERY:
            return out
        category = CATEGORY_OF_PHASE[self.phase]
        op = str(func.overloadpacket.__name__)
        if func is CAST_OP and self._is_parameter(args[0]):
            op = PARAMETER_CAST
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, category, op)
        if self.workspace is not None:
            self._count_workspace(op, args, out)
        return out

    def _count_workspace(self, op: str, args: Any, out: Any) -> None:
        assert self.workspace is not None
        if op in MATMUL_OPS and self.phase in ("forward", "backward") and self.phase not in self._cublas_phases:
            self._workspace_record(self.workspace.cublas_bytes, "cublas workspace", kept=True)
            self._cublas_phases.add(self.phase)  # kept from the thread's first product on (counted: a budget passed)
        elif op in CONVOLUTION_OPS:
            sizes = [t.numel() * t.element_size() for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
            self._workspace_record(self.workspace.transient_bytes(max(sizes), 0), "cudnn workspace", kept=False)

    def _workspace_record(self, nbytes: int, op: str, kept: bool) -> None:
        nbytes = self._rounded(nbytes)
        if nbytes == 0:
            return
        record = StorageRecord(nbytes, "temporaries", self.attribution.current_module, op, (nbytes,), torch.uint8)
        key = -self._events - 1  # no storage has a negative id
        with self._lock:
            self._grow(nbytes, record)
            self._records[key] = record
            if not kept:  # freed when the kernel ends: a peak it made keeps it among its records
                self._settle()
                del self._records[key]
                self._drop(record, nbytes)

    def _is_parameter(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        records = (self._records.get(id(storage)) for storage, _ in storages(tensor))
        return any(record is not None and record.category == "parameters" for record in records)


# `tensor.device` of a fake tensor reaches the modes as this op (autocast and autograd ask often): no storage
_DEVICE_QUERY = torch.ops.prim.device.default
# the trackers inside their `with` block: told of every in-place storage resize
_RESIZE_WATCHERS: list[MemoryTracker] = []
_TORCH_RESIZE = torch.UntypedStorage.resize_


def tracking() -> bool:
    """Whether a :class:`MemoryTracker` is counting now (inside its ``with`` block), in any thread.

    Code that would hide an allocation from it (a buffer kept for reuse) allocates anew meanwhile.

    Example::

        >>> with MemoryTracker():
        ...     inside = tracking()
        >>> inside, tracking()
        (True, False)
    """
    return bool(_RESIZE_WATCHERS)


def _counted_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    # UntypedStorage.resize_ does not reach dispatch modes: the trackers hear of it here
    result = _TORCH_RESIZE(storage, size)
    for tracker in _RESIZE_WATCHERS:
        tracker._resized(storage)
    return result


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
