"""What one offloaded step holds: host copies deduplicated by device storage, and the groups that use them.

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

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from lightning_memopt.checkpointing.offload_schedule import PrefetchSchedule
from lightning_memopt.private_api import tensor_version

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
    """The groups offloaded since none was alive, and their host copies by device storage."""

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
