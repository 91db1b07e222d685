"""A block's own memory-lean recomputation: what it costs, so that the planner can weigh it.

A module may define ``checkpointed_forward``: checkpointing it in ``"lean"`` mode then calls it
(it keeps only its inputs and recomputes in pieces, e.g. channel chunks or spatial tiles, so its
backward holds less again, for more kernels and sometimes more forwards); in ``"full"`` mode it is
recomputed plainly, one forward again and nothing more. Its ``lean_recompute()`` says what the lean
path costs next to the plain one; an activation budget's planner weighs both
(:func:`~lightning_memopt.planner.plan_checkpointing`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LeanRecompute:
    """What a block's ``checkpointed_forward`` costs next to plain full checkpointing.

    Args:
        held_fraction: of the bytes the block saves without checkpointing, the most its backward holds
            again at once (plain checkpointing: 1; ``n`` chunks: about 1/n).
        forwards: its forward work run again, counted in forwards (plain checkpointing: 1; a tiled
            chain that recomputes its statistics in several passes: more).

    Example::

        >>> LeanRecompute(held_fraction=1 / 8, forwards=1.0).held_fraction
        0.125
    """

    held_fraction: float
    forwards: float

    @property
    def cut(self) -> bool:
        """Whether it differs from plain checkpointing (in one piece, one forward, it is the plain one).

        Example::

            >>> LeanRecompute(held_fraction=1.0, forwards=1.0).cut, LeanRecompute(held_fraction=0.5, forwards=1.0).cut
            (False, True)
        """
        return (self.held_fraction, self.forwards) != (1.0, 1.0)


def lean_recompute(module: nn.Module) -> LeanRecompute | None:
    """The cost ``module``'s own ``checkpointed_forward`` declares, or None (it has none: plain checkpointing).

    Example::

        >>> lean_recompute(nn.Linear(2, 2)) is None
        True
    """
    declared = getattr(module, "lean_recompute", None)
    if not callable(getattr(module, "checkpointed_forward", None)) or not callable(declared):
        return None
    cost = declared()
    if not isinstance(cost, LeanRecompute):
        raise TypeError(f"{type(module).__name__}.lean_recompute() must return a LeanRecompute, got {cost!r}")
    return cost
