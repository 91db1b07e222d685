"""What offloading adds to a step on a GPU: the seconds its compute waits for copies the link could not hide.

The runtime (:mod:`~lightning_memopt.checkpointing.offload`) copies an offloaded block's saved
activations to the host on a stream of their own as its forward makes them (the copies out queue
one after another), and back on another stream (one per direction: the link carries both at
once). When the backward first unpacks an offloaded block, its copies back start, unless already
on their way, and then those of the offloaded block before it: those overlap this block's
backward. A block's copies back follow its copies out, and its backward waits for them. So:

- bytes out overlap the forward compute after the block (and the backward, if the link lags);
- bytes back overlap the backward compute before the block's, from the first unpack of the next
  offloaded block on: the last offloaded block's come back while nothing else runs, so the blocks
  whose backward comes first are better kept on the device (or recomputed).

:func:`copy_waits` plays that schedule on seconds (a pure function): per block, the seconds the
compute waits for its copies back, the part of its copy time the step's compute cannot hide. The
step it prices is never shorter than all the bytes through one direction of the link: the last copy
back follows every other one. :func:`unhidden_seconds` prices each block on its own: the part of
its copies the next block's compute cannot hide. Offloading only blocks it prices at 0, a step
waits for nothing but the way back of the last block it offloads. :func:`offloaded_blocks` lists
a step's blocks from their forwards' work (:func:`~lightning_memopt.planner.estimate.copy_schedule` reads them
from the profile of the step without checkpointing, the anchor);
:func:`~lightning_memopt.planner.cost.block_seconds` turns their work into seconds on a device.

Example::

    >>> blocks = [BlockSeconds(1.0, 2.0, copy=0.5), BlockSeconds(1.0, 2.0, copy=0.5), BlockSeconds(1.0, 2.0)]
    >>> copy_waits(blocks)  # the second block is the last offloaded: its backward waits for its copies back
    [0.0, 0.5, 0.0]
    >>> copy_waits([BlockSeconds(1.0, 2.0, copy=3.0), BlockSeconds(1.0, 2.0)])  # out 1 → 4, back 4 → 7: due at 4
    [3.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_memopt.memory.work import Work


@dataclass(frozen=True)
class BlockSeconds:
    """One block of a step, in forward order: the seconds of its forward and its backward, and the seconds its
    offloaded bytes take over the link, each way (0: nothing offloaded)."""

    forward: float
    backward: float
    copy: float = 0.0


@dataclass(frozen=True)
class OffloadedBlock:
    """One block of a step, in forward order: the work of its forward and of its backward (recomputation
    included), and the bytes it offloads (0: none)."""

    forward: Work
    backward: Work
    offloaded_bytes: float = 0.0


def copy_waits(blocks: Sequence[BlockSeconds]) -> list[float]:
    """Per block of ``blocks`` (in forward order), the seconds the compute waits for its copies back.

    Compute runs the forwards in order, then the backwards in reverse; copies out queue on one
    stream from the end of their block's forward; copies back queue on the other when the backward
    first unpacks their block or the next offloaded one, after their copies out. Compute outside
    the blocks (a stem, a head, the loss) is left out: it hides nothing here.
    """
    now, out_free = 0.0, 0.0
    out_done: dict[int, float] = {}
    for index, block in enumerate(blocks):
        now += block.forward
        if block.copy > 0:
            out_free = max(now, out_free) + block.copy
            out_done[index] = out_free
    offloaded = list(out_done)
    before = {index: offloaded[n - 1] if n else None for n, index in enumerate(offloaded)}
    back_free = 0.0
    back_done: dict[int, float] = {}
    waits = [0.0] * len(blocks)
    for index in reversed(range(len(blocks))):
        if index in out_done:
            for due in (index, before[index]):  # the schedule's order: this block's copies, then the one before
                if due is not None and due not in back_done:
                    back_free = max(now, back_free, out_done[due]) + blocks[due].copy
                    back_done[due] = back_free
            waits[index] = max(0.0, back_done[index] - now)
            now += waits[index]
        now += blocks[index].backward
    return waits


def unhidden_seconds(blocks: Sequence[BlockSeconds]) -> list[float]:
    """Per block of ``blocks`` (in forward order), the seconds of its copies the block after it cannot hide: out
    past that block's forward, back past its backward (the last block: all of both).

    A block priced 0 is hidden whichever other such blocks are offloaded: the copies out never queue
    past the next block's forward, and each block's copies back (started at the latest when the
    backward first unpacks the block after it) are back before its own backward, so the step waits
    only for the last offloaded block's way back.

    Example::

        >>> blocks = [BlockSeconds(1.0, 2.0, copy=1.0), BlockSeconds(1.0, 2.0, copy=1.5), BlockSeconds(1.0, 2.0)]
        >>> unhidden_seconds(blocks)  # the second block's copies out outlast the third block's forward by 0.5
        [0.0, 0.5, 0.0]
        >>> unhidden_seconds([BlockSeconds(1.0, 2.0, copy=0.5)])  # nothing after it: out and back in the open
        [1.0]
    """
    after = [*blocks[1:], BlockSeconds(0.0, 0.0)][: len(blocks)]
    return [max(0.0, b.copy - a.forward) + max(0.0, b.copy - a.backward) for b, a in zip(blocks, after, strict=True)]


def offloaded_blocks(
    forwards: Mapping[str, Work],
    backward_ratio: float,
    offloaded: Mapping[str, float],
    recomputed: Mapping[str, Work] | None = None,
) -> tuple[OffloadedBlock, ...]:
    """Each block of ``forwards`` (block name → the work of its forward, in forward order) with the bytes
    ``offloaded`` says it offloads (block name → bytes); its backward priced as its forward's work scaled by
    ``backward_ratio`` (a profile counts backward work for the step, not per block) plus ``recomputed``, the work
    it runs again (block name → work).

    Example::

        >>> forwards = {"a": Work(full_flops=1e9), "b": Work(full_flops=2e9)}
        >>> blocks = offloaded_blocks(forwards, 2.0, {"a": 1e6}, {"b": Work(full_flops=2e9)})
        >>> [(block.backward.flops, block.offloaded_bytes) for block in blocks]
        [(2000000000.0, 1000000.0), (6000000000.0, 0.0)]
    """
    recomputed = recomputed or {}
    return tuple(
        OffloadedBlock(work, work.scaled(backward_ratio) + recomputed.get(name, Work()), offloaded.get(name, 0.0))
        for name, work in forwards.items()
    )
