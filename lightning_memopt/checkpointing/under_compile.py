"""Checkpointed blocks under ``torch.compile``: a forward's Python side effects traced once, graph breaks named.

Dynamo traces a checkpointed block into a higher-order op, and by default refuses a forward there that changes
Python state. transformers' Swin sets its layer's ``shift_size`` from the input's size, so the graph broke at every
block; each block then compiled as a frame of its own, recompiled per block up to dynamo's recompile limit, and one
Swin never finished two steps in 30 minutes. While any block is checkpointed, dynamo lets such a change run once, in
the forward (:func:`hold_side_effects`), as the eager checkpointing's traced recomputation does. Whatever else
breaks the graph at a checkpointed block is said once, with the blocks and the fix (:class:`CompiledCheckpointWatch`).

Example::

    >>> from torch import nn
    >>> from lightning_memopt.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
    >>> from lightning_memopt.private_api import compiled_checkpoint_side_effects
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> apply_activation_checkpointing(model, [nn.Linear]), compiled_checkpoint_side_effects()
    (2, True)
    >>> remove_activation_checkpointing(model)  # torch's setting comes back once no checkpointed block is left
    2
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from lightning_memopt.private_api import (
    compiled_checkpoint_side_effects,
    compiled_frames,
    graph_break_reasons,
    recompile_limit,
)

# what a graph-break reason names when it broke at a checkpointed block: the recomputing higher-order op, or
# offloading's saved-tensor hooks (entered uncompiled)
_AT_BLOCKS = ("torch.utils.checkpoint.checkpoint", "_OffloadContext")


class _SideEffectsHold:
    """The checkpointed blocks' forwards alive, and dynamo's setting before the first: restored after the last (one
    unwrapped, or one collected with its model)."""

    holders: weakref.WeakSet[Any] = weakref.WeakSet()
    held = False
    before = False


def hold_side_effects(forward: object) -> None:
    """A checkpointed block's ``forward``: dynamo traces its Python side effects once, in the forward."""
    if not _SideEffectsHold.held:
        _SideEffectsHold.before = compiled_checkpoint_side_effects(True)
        _SideEffectsHold.held = True
    _SideEffectsHold.holders.add(forward)
    weakref.finalize(forward, _restore_when_none_left)


def release_side_effects(forward: object) -> None:
    """A block no longer checkpointed: after the last, dynamo's setting is as it was."""
    _SideEffectsHold.holders.discard(forward)
    _restore_when_none_left()


def _restore_when_none_left() -> None:
    if _SideEffectsHold.held and not any(True for _ in _SideEffectsHold.holders):  # the live ones only
        compiled_checkpoint_side_effects(_SideEffectsHold.before)
        _SideEffectsHold.held = False


class CompiledCheckpointWatch:
    """After compiled steps, whether dynamo broke its graph at a checkpointed block: one line saying so, once.

    ``wrapper`` is the checkpointed blocks' instance ``forward`` (a graph broken at a block compiles that function
    as a frame, once per block); ``blocks`` names them (class -> count). Graph breaks before :meth:`start` are not
    this run's.

    Example::

        >>> def forward(x):
        ...     return x
        >>> watch = CompiledCheckpointWatch(forward)
        >>> watch.start()
        >>> watch.trouble(Counter(Block=4)) is None
        True
    """

    def __init__(self, wrapper: Callable[..., Any]) -> None:
        self.wrapper = wrapper
        self.breaks_before: set[str] = set()
        self.frames_before = 0
        self.said = False

    def start(self) -> None:
        """Forget what dynamo met before this run."""
        self.breaks_before = set(graph_break_reasons())
        self.frames_before = compiled_frames(self.wrapper)
        self.said = False

    def trouble(self, blocks: Counter[str]) -> str | None:
        """The one line to warn with, the first time the graph broke at a checkpointed block; else ``None``."""
        if self.said:
            return None
        breaks = [reason for reason in graph_break_reasons() if reason not in self.breaks_before]
        at_blocks = [reason for reason in breaks if any(mark in reason for mark in _AT_BLOCKS)]
        frames = compiled_frames(self.wrapper)
        limit = recompile_limit()
        storm = frames >= limit and frames > self.frames_before
        if not at_blocks and not storm:
            return None
        self.said = True
        names = ", ".join(f"{name} ×{count}" for name, count in blocks.most_common())
        cause = _first_lines(at_blocks[0]) if at_blocks else "a graph break inside the blocks"
        if at_blocks and "_OffloadContext" in at_blocks[0]:
            cause = "offloading's saved-tensor hooks run uncompiled, so the graph breaks around each offloaded block"
        storm_words = (
            f"; the blocks compiled as {frames} frames of their own and reached dynamo's recompile limit "
            f"({limit}), so the rest run uncompiled"
            if storm
            else "; each block compiles as a frame of its own"
        )
        return (
            f"torch.compile broke its graph at the checkpointed blocks ({names}): {cause}{storm_words}. Fix: make the "
            "blocks traceable (TORCH_LOGS=graph_breaks shows where), checkpoint other modules with the `policy`, or "
            "leave recomputation to the compiler (no checkpointing; the activation_memory_budget of functorch's config)"
        )


def _first_lines(reason: str) -> str:
    """A graph-break reason's headline and its explanation, on one line."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    kept = [line for line in lines[:3] if not line.startswith("Higher Order Operator")]
    return " ".join(kept[:2]).rstrip(".")
