"""How offloaded activations cross the host link: on CUDA a stream each way, events and pinned buffers reused.

:class:`ImmediateCopies` copies at once into plain host memory: the CPU (where offloading is the
accounting of what a device would move), fake tensors, devices without a stream path.

:class:`StreamCopies` copies a saved activation to pinned host memory on a side stream of its
device (*out*), ordered after the compute stream, and never on the hot path's host: no
synchronize. The device tensor is ``record_stream``-ed on that stream, so the caching allocator
reuses its memory only once the copy has read it. Coming back runs on another side stream
(*back*: the link carries both directions at once, and a prefetch never queues behind copies
out): the device memory is allocated on the compute stream, the back stream waits for the compute
stream to reach that point and for the copy's way out (its event), copies, and records the event
that the compute stream waits on before the tensor is used. Streams and the ``record_stream`` call
come from a :class:`CudaStreams` (a recorded fake in the tests, which run on the CPU).

:class:`PinnedBufferPool` keeps the pinned buffers (``cudaHostAlloc`` is slow) for the next step,
by byte size. A buffer returns to it when the last saved tensor using it is released, with the
event of the last copy that touched it; whoever takes it next orders its copy after that event.

Example::

    >>> pool = PinnedBufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))  # pinned on CUDA
    >>> buffer = pool.take(1000, stream=None)
    >>> pool.give_back(buffer, event=None)
    >>> pool.take(1000, stream=None) is buffer, pool.allocations
    (True, 1)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_memopt.memory.tracker import tracking

# pooled buffers come in multiples of this many bytes (the CUDA caching allocator's block size)
POOL_GRANULARITY = 512


class PinnedBufferPool:
    """Host buffers for offloaded activations, kept after use and handed out again by byte size.

    The bound: the buffers the pool holds, idle and in use together, never exceed the most bytes
    it had in use at once (one step's offloaded activations, in a steady run): when a size must be
    made anew, idle buffers of other sizes are dropped first. :meth:`release` drops every idle one.

    Args:
        allocate: makes a new buffer of a given number of bytes (a 1-D ``uint8`` tensor; pinned on CUDA).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._idle: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # size -> (buffer, event of its last copy)
        # taken in the forward, given back wherever autograd releases a copy (re-entered if a garbage
        # collection inside frees one meanwhile)
        self._lock = threading.RLock()
        self.idle_bytes = 0
        self.in_use_bytes = 0
        self.most_in_use_bytes = 0
        self.allocations = 0  # buffers made so far

    def take(self, nbytes: int, stream: Any) -> torch.Tensor:
        """A buffer of at least ``nbytes``; ``stream`` (a CUDA stream, or None) is ordered after its last copy."""
        size = -(-nbytes // POOL_GRANULARITY) * POOL_GRANULARITY
        with self._lock:
            kept = self._idle.get(size)
            buffer, event = kept.pop() if kept else (None, None)
            self.idle_bytes -= size if buffer is not None else 0
            self.in_use_bytes += size
            self.most_in_use_bytes = max(self.most_in_use_bytes, self.in_use_bytes)
            if buffer is None:
                self._drop_idle(self.idle_bytes + self.in_use_bytes - self.most_in_use_bytes)
                self.allocations += 1
        if buffer is None:
            return self._allocate(size)
        if event is not None:
            stream.wait_event(event)
        return buffer

    def give_back(self, buffer: torch.Tensor, event: Any) -> None:
        """Keep ``buffer`` for reuse; ``event`` (or None) completes when the last copy touching it has."""
        size = buffer.numel()
        with self._lock:
            self.in_use_bytes -= size
            self.idle_bytes += size
            self._idle.setdefault(size, []).append((buffer, event))

    def release(self) -> int:
        """Drop every idle buffer; the bytes dropped."""
        with self._lock:
            released = self.idle_bytes
            self._drop_idle(released)
            return released

    def _drop_idle(self, nbytes: int) -> None:
        """Drop idle buffers, the sizes kept longest first, until ``nbytes`` are gone (or none is left)."""
        while nbytes > 0 and self._idle:
            size, kept = next(iter(self._idle.items()))
            kept.pop()
            if not kept:
                del self._idle[size]
            self.idle_bytes -= size
            nbytes -= size


class ImmediateCopies:
    """Copies made at once, in plain host memory.

    Args:
        allocate_host: makes a host tensor ``(shape, dtype, pinned)``, counted as host memory.
    """

    def __init__(self, allocate_host: Callable[[Sequence[int], torch.dtype, bool], torch.Tensor]) -> None:
        self._allocate_host = allocate_host

    def to_host(self, copy: Any, source: torch.Tensor) -> None:
        """Copy ``source`` to a new host tensor, ``copy.host``."""
        copy.host = self._allocate_host(source.shape, source.dtype, False)
        copy.host.copy_(source)

    def to_device(self, copies: Sequence[Any]) -> None:
        """Set each ``copy.image``: on the CPU the host copy itself (as the backward always read it)."""
        for copy in copies:
            copy.image = copy.host if copy.device.type == "cpu" else copy.host.to(copy.device)

    def wait(self, copy: Any) -> None:
        """Nothing to wait for: the copies were made at once (and took no pooled buffer to release)."""


class CudaStreams:
    """Where :class:`StreamCopies` gets its streams: CUDA's.

    A stand-in gives the same four calls, and streams with ``wait_stream``, ``wait_event`` and
    ``record_event`` (as ``torch.cuda.Stream`` has them).

    Example::

        >>> streams = CudaStreams()
        >>> callable(streams.new) and callable(streams.current)
        True
    """

    def new(self, device: torch.device) -> Any:
        """A new stream on ``device``."""
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device) -> Any:
        """The stream ``device`` computes on now."""
        return torch.cuda.current_stream(device)

    def using(self, stream: Any) -> Any:
        """A context in which kernels are queued on ``stream``."""
        return torch.cuda.stream(stream)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is reused only once what ``stream`` has queued so far is done."""
        tensor.record_stream(stream)


class StreamCopies:
    """Copies of saved activations between a CUDA device and pinned host memory, on two side streams per device:
    one to the host (out), one back.

    Args:
        allocate_host: makes a host tensor ``(shape, dtype, pinned)``, counted as host memory.
        pooled: whether a new copy may take its buffer from :attr:`pool` (not while a
            :class:`~lightning_memopt.memory.MemoryTracker` counts: it must see each allocation).
        streams: where the streams come from (default CUDA's, :class:`CudaStreams`).
    """

    def __init__(
        self,
        allocate_host: Callable[[Sequence[int], torch.dtype, bool], torch.Tensor],
        pooled: Callable[[], bool] = lambda: not tracking(),
        streams: CudaStreams | None = None,
    ) -> None:
        self._allocate_host = allocate_host
        self._pooled = pooled
        self.streams = streams if streams is not None else CudaStreams()
        self.pool = PinnedBufferPool(lambda nbytes: allocate_host((nbytes,), torch.uint8, True))
        self._side: dict[torch.device, tuple[Any, Any]] = {}

    def side_streams(self, device: torch.device) -> tuple[Any, Any]:
        """The streams this device's copies to the host and back run on, in that order (made on first use)."""
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = (self.streams.new(device), self.streams.new(device))
        return side

    def to_host(self, copy: Any, source: torch.Tensor) -> None:
        """Start copying ``source`` to the host; sets ``copy.host``, ``copy.buffer`` and ``copy.event``."""
        out, _ = self.side_streams(source.device)
        nbytes = source.numel() * source.element_size()
        buffer = self.pool.take(nbytes, out) if self._pooled() else None
        if buffer is None:
            host = self._allocate_host(source.shape, source.dtype, True)
        else:
            host = buffer[:nbytes].view(source.dtype).view(source.shape)
        out.wait_stream(self.streams.current(source.device))  # source has been computed
        with self.streams.using(out):
            host.copy_(source, non_blocking=True)
        self.streams.keep_for(source, out)  # its memory is not reused before the copy has read it
        copy.host, copy.buffer, copy.event = host, buffer, out.record_event()

    def to_device(self, copies: Sequence[Any]) -> None:
        """Start bringing ``copies`` (of one device) back; sets each ``copy.image`` and ``copy.event``."""
        device = copies[0].device
        _, back = self.side_streams(device)
        images = [torch.empty(copy.host.shape, dtype=copy.host.dtype, device=device) for copy in copies]
        back.wait_stream(self.streams.current(device))  # the memory's last use on the compute stream is done
        with self.streams.using(back):
            for copy, image in zip(copies, images, strict=True):
                back.wait_event(copy.event)  # its way out is over
                image.copy_(copy.host, non_blocking=True)
                # an event each: the backward waits for its own tensor, not for the group prefetched behind it
                copy.image, copy.event = image, back.record_event()
        for image in images:
            self.streams.keep_for(image, back)  # freed unused (a backward cut short), it waits for the copy

    def wait(self, copy: Any) -> None:
        """Order the compute stream after ``copy``'s way back."""
        self.streams.current(copy.device).wait_event(copy.event)

    def release(self, buffer: torch.Tensor, event: Any) -> None:
        """``buffer`` is no longer used by a saved tensor: back to the pool, behind ``event``."""
        self.pool.give_back(buffer, event)
