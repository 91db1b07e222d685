"""What was live at a CUDA run's peak: the allocator's recorded trace replayed, its live blocks grouped by the code
that made them.

Record the allocator's history around the run (``torch.cuda.memory._record_memory_history``, through
:func:`~lightning_memopt.private_api.record_cuda_memory_history`), take the snapshot, and
:func:`live_at_peak` replays the device's trace — ``alloc`` adds a block's bytes, ``free_requested`` takes them
away, as the allocator's count of allocated bytes does — to the moment the most bytes were allocated, then groups
the blocks live there by the first Python frame of each block's stack outside PyTorch's own files: the line of
model or library code that asked for it. Where a prediction misses the allocator, this says which tensors the
prediction did not see.

Example::

    >>> frames = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "conv2d"},
    ...           {"filename": "/x/model.py", "line": 12, "name": "forward"}]
    >>> trace = [{"action": "alloc", "addr": 1, "size": 1024, "frames": frames},
    ...          {"action": "alloc", "addr": 2, "size": 256, "frames": frames[1:]},  # counted as 512
    ...          {"action": "free_requested", "addr": 1, "size": 1024},
    ...          {"action": "alloc", "addr": 3, "size": 512, "frames": []}]
    >>> peak, groups = live_at_peak({"device_traces": [trace]})
    >>> peak, [(group.where, group.bytes, group.blocks) for group in groups]
    (1536, [('/x/model.py:12 forward', 1536, 2)])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALLOCATOR_ROUNDING = 512  # the caching allocator's smallest block and granularity
TORCH_FILES = ("/torch/", "\\torch\\")  # frames inside PyTorch itself, skipped to reach the code that asked


@dataclass(frozen=True)
class PeakGroup:
    """Blocks live at the peak that one line of code allocated: where, their bytes, how many."""

    where: str
    bytes: int
    blocks: int


def live_at_peak(snapshot: Mapping[str, Any], device: int = 0, top: int = 8) -> tuple[int, list[PeakGroup]]:
    """The most bytes allocated at once in ``snapshot``'s trace of ``device``, and the ``top`` groups of blocks live
    then, largest first.

    Bytes are counted as the allocator counts ``allocated``: a block from its ``alloc`` to its ``free_requested``
    (its bytes are no longer allocated once freed, even while another stream still uses them), each rounded up to
    the allocator's 512 bytes. Blocks allocated before the history started are not in the trace, so not counted.
    """
    trace = snapshot["device_traces"][device]
    sizes: dict[int, int] = {}
    allocated = peak = 0
    peak_index = -1
    for index, event in enumerate(trace):  # first pass: when the peak was
        if event["action"] == "alloc":
            sizes[event["addr"]] = _rounded(event["size"])
            allocated += sizes[event["addr"]]
            if allocated > peak:
                peak, peak_index = allocated, index
        elif event["action"] == "free_requested" and event["addr"] in sizes:
            allocated -= sizes.pop(event["addr"])
    live: dict[int, Mapping[str, Any]] = {}
    for event in trace[: peak_index + 1]:  # second pass: what was live then
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        groups.setdefault(_where(event.get("frames", ())), []).append(_rounded(event["size"]))
    ranked = sorted((PeakGroup(where, sum(blocks), len(blocks)) for where, blocks in groups.items()), key=_largest)
    return peak, ranked[:top]


def describe(groups: Sequence[PeakGroup]) -> str:
    """One line: ``"model.py:12 forward 512.0 MiB ×3; …"``.

    Example::

        >>> describe([PeakGroup("/x/model.py:12 forward", 3 * 2**20, 3)])
        'model.py:12 forward 3.0 MiB ×3'
    """
    return "; ".join(
        f"{group.where.rsplit('/', 1)[-1]} {group.bytes / 2**20:.1f} MiB ×{group.blocks}" for group in groups
    )


def _where(frames: Sequence[Mapping[str, Any]]) -> str:
    for frame in frames:
        filename = frame["filename"]
        if filename.endswith(".py") and not any(part in filename for part in TORCH_FILES):  # no C++ frame
            return f"{filename}:{frame['line']} {frame['name']}"
    return "(no Python frame outside torch)"


def _rounded(size: int) -> int:
    return max(ALLOCATOR_ROUNDING, -(-size // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING)


def _largest(group: PeakGroup) -> tuple[int, str]:
    return -group.bytes, group.where
