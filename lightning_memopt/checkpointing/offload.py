"""Offloading: keep the activations saved for the backward pass in host memory, not on the device.

Each ``offload_to_host()`` context (one offloaded block call) packs one *group*; the groups packed
while any of them still holds an offloaded tensor make one *step*, scoped by their lifetimes (held
by the saved tensors, weakly by everything else: nothing outlives the backward pass that releases
them). Within a step:

- a storage is copied once: the same tensor saved by several ops, or views of one storage (a
  block's output saved by its last op and by the next block's first op; the heads of a packed
  projection), in one group or several, share one host copy, and the views come back with their
  sizes, strides and offset, so kernels take the same path (see :class:`OffloadStep`). Parameters
  and their views, empty tensors and tensors that are not plain strided ones (sparse, subclasses,
  lazy conjugates) stay in place.
- on CUDA the copies run on two side streams, one to the host and one back (the link carries both
  directions at once), with pinned buffers reused across steps, and the first unpack of a group in
  the backward pass starts bringing back that group (if not yet on its way) and the one packed
  before it, so the next block's tensors cross the link while this block's backward computes: a
  block's backward holds its own offloaded tensors and the next one's. The last group packed comes
  back while nothing else runs (its backward comes first): on a GPU the planner offloads the blocks
  whose copies the step's compute hides and keeps the last ones on the device, unless nothing else
  fits (see :mod:`~lightning_memopt.planner.offload_price`, :class:`PrefetchSchedule` and
  :mod:`~lightning_memopt.checkpointing.offload_copies`). Nothing synchronizes the host. The pinned
  buffers stay for the next step, never more bytes than the most a step had in use at once;
  :func:`release_offload_buffers` frees them, :func:`offload_stats` tells what is held.

The minimum size (``min_bytes``, default :data:`MIN_OFFLOAD_BYTES` = 1 MiB): a saved tensor whose
storage holds fewer bytes stays on the device. Each copy costs a fixed ~5–10 µs on the link (DMA
setup and launch) and ~10–20 µs of Python in the hooks, each way; a host link moves 25 GB/s (PCIe
4) to ~50 GB/s (PCIe 5), i.e. 0.25–0.5 MB in 10 µs. At 1 MiB a copy spends ≥ 2/3 of its link time
moving bytes, and what stays behind is small: per-channel norm statistics, masks, scalars (r100 at
batch 128, 112×112: 604 of the 906 tensors its blocks save, 0.5 MiB of 12.5 GiB; sapiens_0.3b at
512×384, bf16: 132 of 444 storages, 1.4 MiB of 2.1 GiB). It applies to accelerator tensors (fake
ones too, so a fake-mode profile of a CUDA model sees what the device keeps), not to CPU tensors:
a CPU run's offload is the accounting of what a device would move, and counts every saved tensor.

On the CPU (and for fake tensors) the copy is made at once into plain host memory inside
:func:`~lightning_memopt.memory.tracker.host_memory`, so a
:class:`~lightning_memopt.memory.MemoryTracker` counts it as host memory, not device memory; no
pool is used (reuse would hide allocations from the tracker), and the backward gets views of the
host copy: gradients and outputs are bitwise those of no offloading.
"""

from __future__ import annotations

import bisect
import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.arguments import check_int
from lightning_memopt.checkpointing.offload_copies import ImmediateCopies, StreamCopies
from lightning_memopt.memory.tracker import host_memory
from lightning_memopt.private_api import is_fake, is_traceable_wrapper_subclass, storage_base, tensor_version
from lightning_memopt.vocabulary import MIB

MIN_OFFLOAD_BYTES = MIB  # the default ``min_bytes``: the reasoning is in the module's docstring
_LOCAL = threading.local()  # .step: a weak reference to the step the forward in this thread packs into


def _host_tensor(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor that a tracker counts as host memory (on any device, under fake tensors too)."""
    with host_memory():
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


_IMMEDIATE_COPIES = ImmediateCopies(_host_tensor)
_STREAM_COPIES = StreamCopies(_host_tensor)


class _Packed:
    """What autograd keeps of an offloaded tensor: its host copy, its group and how to view the copy."""

    __slots__ = ("copy", "group", "offset", "size", "stride")

    def __init__(self, copy: HostCopy, group: OffloadGroup, tensor: torch.Tensor) -> None:
        self.copy, self.group = copy, group
        self.size, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()


def _stays(tensor: torch.Tensor, min_bytes: int) -> bool:
    """Whether ``tensor`` is saved as it is: a parameter, empty, not plain strided, or too small to be worth a copy."""
    if isinstance(storage_base(tensor), nn.Parameter) or tensor.numel() == 0:
        return True  # weights (and their transposes) are on the device anyway
    if tensor.layout != torch.strided or is_traceable_wrapper_subclass(tensor) or tensor.is_conj() or tensor.is_neg():
        return True  # sparse, nested, subclasses, and lazily conjugated or negated views (a copy would resolve them)
    return tensor.device.type != "cpu" and tensor.untyped_storage().nbytes() < min_bytes


def _transport(tensor: torch.Tensor) -> Any:
    """How ``tensor`` crosses the link: on CUDA streams, else at once."""
    return _STREAM_COPIES if tensor.is_cuda and not is_fake(tensor) else _IMMEDIATE_COPIES


def _pack(group: OffloadGroup, min_bytes: int, tensor: torch.Tensor) -> torch.Tensor | _Packed:
    if _stays(tensor, min_bytes):
        return tensor
    copy = group.step.host_copy(tensor, _transport(tensor))
    group.hold(copy)
    return _Packed(copy, group, tensor)


def _unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
    if not isinstance(packed, _Packed):
        return packed
    due = packed.group.step.schedule.first_unpack(packed.group)
    # this group's copies in the order its backward wants them (the reverse of packing), then the next group's
    _bring_back([copy for group in due for copy in reversed(group.live())] + [packed.copy])
    packed.copy.transport.wait(packed.copy)
    return packed.copy.view(packed.size, packed.stride, packed.offset)


def _bring_back(copies: list[HostCopy]) -> None:
    """Start the way back of those of ``copies`` not yet on it, per transport and device, in order."""
    waiting: dict[tuple[Any, torch.device], dict[int, HostCopy]] = {}
    for copy in copies:
        if copy.image is None:
            waiting.setdefault((copy.transport, copy.device), {})[id(copy)] = copy
    for (transport, _), batch in waiting.items():
        transport.to_device(list(batch.values()))


def _live_step() -> OffloadStep | None:
    """The step this thread's forward packs into, while any of its groups is alive."""
    reference = getattr(_LOCAL, "step", None)
    return reference() if reference is not None else None


class _OffloadContext:
    """One offloaded block call: a group of the current step, packed by saved-tensor hooks."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    @torch.compiler.disable  # run as it is, not traced: what it sets up is for the saved-tensor hooks at run time
    def __enter__(self) -> _OffloadContext:
        step = _live_step()
        if step is None:
            step = OffloadStep()
            _LOCAL.step = weakref.ref(step)
        group = OffloadGroup(step)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, group, self.min_bytes), _unpack)
        self._hooks.__enter__()
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None  # the group lives on in what it packed, no longer here


def offload_to_host(min_bytes: int = MIN_OFFLOAD_BYTES) -> Any:
    """A context in which tensors saved for backward are copied to (pinned) host memory.

    Parameters stay where they are, and so do accelerator tensors whose storage holds fewer than
    ``min_bytes``. On CUDA the copies overlap compute on a side stream each way and come back one
    block ahead of the backward pass (see the module's docstring). On a CPU-only machine the copy saves
    nothing; a :class:`~lightning_memopt.memory.MemoryTracker` counts the copies as host memory,
    so a CPU run shows what offloading saves on a device.

    Args:
        min_bytes: the least storage bytes an accelerator tensor must hold to be copied
            (default :data:`MIN_OFFLOAD_BYTES`, 1 MiB); 0 copies every one.

    Raises:
        TypeError: ``min_bytes`` is not an integer.
        ValueError: ``min_bytes`` is negative.

    Example::

        >>> x = torch.randn(64, requires_grad=True)
        >>> with offload_to_host():
        ...     y = (x.sin() * 2).sum()
        >>> y.backward()
        >>> torch.allclose(x.grad, 2 * x.cos())
        True
    """
    return _OffloadContext(check_int("min_bytes", min_bytes, minimum=0))


@dataclass(frozen=True)
class OffloadStats:
    """What offloading holds now: this thread's step (its groups and host copies) and the pinned pool."""

    groups: int  # offloaded block calls whose tensors the backward pass has not released yet
    host_copies: int
    host_bytes: int  # held by those copies
    pooled_bytes: int  # pinned bytes kept idle for the next step
    pinned_allocations: int  # pinned buffers the pool has made in this process


def offload_stats() -> OffloadStats:
    """What offloading holds now (after a backward pass: no group, no copy).

    Example::

        >>> x = torch.randn(256, requires_grad=True)
        >>> with offload_to_host():
        ...     y = x.exp().sum()
        >>> stats = offload_stats()
        >>> stats.groups, stats.host_copies, stats.host_bytes
        (1, 1, 1024)
        >>> y.backward()
        >>> offload_stats().groups
        0
    """
    step = _live_step()
    groups = step.schedule.live_groups() if step is not None else []
    copies = {id(copy): copy for group in groups for copy in group.live()}
    pool = _STREAM_COPIES.pool
    return OffloadStats(
        groups=len(groups),
        host_copies=len(copies),
        host_bytes=sum(copy.host.nbytes for copy in copies.values()),
        pooled_bytes=pool.idle_bytes,
        pinned_allocations=pool.allocations,
    )


def release_offload_buffers() -> int:
    """Free the pinned buffers kept for reuse (and PyTorch's cache of pinned memory); the bytes the pool dropped.

    Example::

        >>> release_offload_buffers() >= 0
        True
    """
    released = _STREAM_COPIES.pool.release()
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # torch >= 2.12
    if torch.cuda.is_initialized() and empty_host_cache is not None:
        empty_host_cache()
    return released


WHOLE_STORAGE_FACTOR = 4  # a view with gaps copies its whole storage up to this many times its own bytes
ALIGNMENT = 512  # bytes: a view's offset into its copy keeps its offset into its storage modulo this


class HostCopy:
    """One host copy of elements ``[start, end)`` of a device storage (or of one view, compacted: ``geometry``).

    ``transport`` sets ``host`` (and, on CUDA, ``buffer`` and ``event``) now, ``image`` (the copy
    back on the device) when the backward pass wants it.
    """

    def __init__(self, tensor: torch.Tensor, transport: Any, version: int, start: int, end: int, geometry: Any) -> None:
        self.device, self.dtype, self.version = tensor.device, tensor.dtype, version
        self.start, self.end, self.geometry = start, end, geometry
        self.transport = transport
        self.host: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None  # the pooled buffer under ``host``
        self.event: Any = None  # the last copy touching ``host`` (on CUDA)
        self.image: torch.Tensor | None = None
        source = tensor.detach()
        transport.to_host(self, source if geometry else source.as_strided((end - start,), (1,), start))

    def holds(self, dtype: torch.dtype, version: int, start: int, end: int, geometry: Any) -> bool:
        """Whether this copy serves a view of its storage with these dtype, version, extent and geometry."""
        if dtype != self.dtype or version != self.version:
            return False
        return geometry == self.geometry if self.geometry else self.start <= start and end <= self.end

    def view(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        """The saved view, rebuilt from ``image``."""
        if self.geometry:
            return self.image
        return self.image.as_strided(size, stride, offset - self.start)

    def __del__(self) -> None:
        if self.buffer is not None:  # no saved tensor uses it now: the pooled buffer goes back
            self.transport.release(self.buffer, self.event)


class OffloadStep:
    """The groups offloaded since none was alive, and their host copies by device storage.

    A step's copies are keyed by the device storage (held weakly, so two tensors never share a copy),
    the dtype and the in-place version counter (a tensor changed in place is copied anew). A saved
    tensor that an existing copy covers reuses it; otherwise a new copy is made of:

    - a dense (or expanded) view: its extent, from a start rounded down to 512 bytes, so the view
      rebuilt from the copy keeps its storage offset modulo 512 bytes (kernels take the same path);
    - a view with gaps: its whole storage when that is at most 4× its own bytes (the heads of a packed
      ``qkv`` projection, the halves of a gated activation: one copy serves them all), else its
      elements alone, compacted (it comes back contiguous, and serves that very view only).

    How a copy moves is its transport's business (see
    :mod:`~lightning_memopt.checkpointing.offload_copies`).

    Example::

        >>> from lightning_memopt.checkpointing.offload_copies import ImmediateCopies
        >>> transport = ImmediateCopies(lambda shape, dtype, pinned: torch.empty(shape, dtype=dtype))
        >>> step = OffloadStep()
        >>> heads = torch.randn(4, 3, 8).unbind(1)  # three views with gaps of one storage
        >>> copies = {step.host_copy(head, transport) for head in heads}
        >>> len(copies), copies.pop().host.shape
        (1, torch.Size([96]))
    """

    def __init__(self) -> None:
        self.schedule = PrefetchSchedule()
        self._copies: weakref.WeakKeyDictionary[Any, list[weakref.ref[HostCopy]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def host_copy(self, tensor: torch.Tensor, transport: Any) -> HostCopy:
        """The host copy holding ``tensor``: one already made in this step, or a new one that ``transport`` makes."""
        storage, version, dtype, numel = tensor.untyped_storage(), tensor_version(tensor), tensor.dtype, tensor.numel()
        start = tensor.storage_offset()
        if tensor.is_contiguous():
            end = start + numel
        else:
            end = (
                start + 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
            )
        geometry = (tensor.shape, tensor.stride(), start)
        with self._lock:
            known = [copy for copy in (reference() for reference in self._copies.get(storage, ())) if copy is not None]
            for copy in known:
                if copy.holds(dtype, version, start, end, geometry):
                    return copy
            whole = storage.nbytes() // tensor.element_size()
            if end - start <= numel:  # dense, or overlapping (expanded): its extent, from an aligned start
                start, geometry = start - start % (ALIGNMENT // tensor.element_size()), None
            elif whole <= WHOLE_STORAGE_FACTOR * numel:  # gaps that sibling views fill: all of it
                start, end, geometry = 0, whole, None
            copy = HostCopy(tensor, transport, version, start, end, geometry)
            self._copies[storage] = [*map(weakref.ref, known), weakref.ref(copy)]
            return copy


class OffloadGroup:
    """The host copies one offloaded block call made or reused, in packing order."""

    __slots__ = ("copies", "step", "__weakref__")

    def __init__(self, step: OffloadStep) -> None:
        self.step = step
        self.copies: list[weakref.ref[HostCopy]] = []
        step.schedule.add(self)

    def hold(self, copy: HostCopy) -> None:
        """``copy`` serves a tensor this group saved."""
        if not self.copies or self.copies[-1]() is not copy:
            self.copies.append(weakref.ref(copy))

    def live(self) -> list[HostCopy]:
        """The copies still used by a saved tensor, in packing order."""
        return [copy for copy in (reference() for reference in self.copies) if copy is not None]


_PRUNE_FROM = 64  # groups remembered before released ones are first forgotten


class PrefetchSchedule:
    """Which offloaded groups to bring back when the backward pass first unpacks a group.

    One ``offload_to_host()`` context (one offloaded block call) packs one *group*. The forward pass
    packs the groups in order; the backward pass needs them back in roughly the reverse order. So when
    the backward first unpacks a tensor of a group, that group's copies start (unless already under
    way) and so do those of the group packed just before it, the one the backward needs next: its
    copies overlap this block's backward. The rule is pure Python, kept apart from the copies so that
    it is tested without a device.

    Groups are held weakly: a group whose saved tensors autograd has released (its backward has
    run, or its graph was dropped) disappears from the order, and a prefetch passes over it to the
    group packed before it. A group is started at most once. Released groups are forgotten as new
    ones arrive (a step kept alive by a graph that is never run does not grow without bound).

    Example::

        >>> class Group:  # anything weakly referable stands for a group
        ...     def __init__(self, name):
        ...         self.name = name
        >>> schedule = PrefetchSchedule()
        >>> groups = [Group(name) for name in "abc"]
        >>> for group in groups:
        ...     schedule.add(group)
        >>> [g.name for g in schedule.first_unpack(groups[2])]  # the last block's backward runs first
        ['c', 'b']
        >>> [g.name for g in schedule.first_unpack(groups[1])]  # b was prefetched: only a is due
        ['a']
        >>> schedule.first_unpack(groups[1])  # a group's later unpacks start nothing
        []
    """

    def __init__(self) -> None:
        self._order: list[tuple[int, weakref.ref[Any]]] = []  # (number, group) in the order the forward packed them
        self._number: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._added = 0
        self._kept = _PRUNE_FROM  # prune released groups from the order once it is twice this long
        self._started: weakref.WeakSet[Any] = weakref.WeakSet()  # fetched, or being fetched
        self._unpacked: weakref.WeakSet[Any] = weakref.WeakSet()  # the backward has unpacked from them
        self._lock = threading.Lock()  # the forward's thread adds, autograd's device thread unpacks

    def add(self, group: Any) -> None:
        """Append ``group``, packed after every group added so far."""
        with self._lock:
            self._number[group] = self._added
            self._order.append((self._added, weakref.ref(group)))
            self._added += 1
            if len(self._order) >= 2 * self._kept:
                self._order = [(number, reference) for number, reference in self._order if reference() is not None]
                self._kept = max(len(self._order), _PRUNE_FROM)

    def first_unpack(self, group: Any) -> list[Any]:
        """The groups whose copies to start now that the backward unpacks from ``group``, in that order.

        On the first unpack of ``group``: itself, unless already started, then the nearest live group
        packed before it, unless already started. On any later unpack: none.

        Raises:
            KeyError: ``group`` was never added.
        """
        with self._lock:
            number = self._number[group]
            if group in self._unpacked:
                return []
            self._unpacked.add(group)
            due = [group]
            for _, reference in reversed(self._order[: bisect.bisect_left(self._order, number, key=lambda x: x[0])]):
                previous = reference()
                if previous is not None:
                    due.append(previous)
                    break
            due = [g for g in due if g not in self._started]
            self._started.update(due)
            return due

    def live_groups(self) -> list[Any]:
        """The groups still holding offloaded tensors, in packing order."""
        with self._lock:
            return [group for group in (reference() for _, reference in self._order) if group is not None]

    def __len__(self) -> int:
        """The groups remembered: the live ones, and released ones not yet forgotten."""
        return len(self._order)
