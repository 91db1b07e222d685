"""RandomStateCheckpoint: every rank's random number generators in the checkpoint, back on resume."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_memopt.random_generators import capture_random_state, restore_random_state


class RandomStateCheckpoint(Callback):
    """Save every rank's RNG states in each checkpoint; a resumed fit continues their streams.

    Lightning checkpoints hold the weights, the optimizer and the loops but not the random number
    generators, so dropout, sampled softmax classes (Partial FC) and any other draw of a resumed run
    differ from the uninterrupted run's. With this callback they do not: the states of the saving
    moment (every rank's, gathered) are set back when training resumes, after set-up and the
    sanity check, right before the first batch. A checkpoint from more ranks than the resumed run
    gives each rank its own state; a rank without one keeps its generators (with a warning).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[RandomStateCheckpoint()], logger=False, enable_progress_bar=False)
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        state = capture_random_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, state)  # every rank writes the checkpoint's contents
            return {"ranks": every_rank}
        return {"ranks": [state]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        ranks = state_dict.get("ranks", [])
        if rank < len(ranks):
            self._pending = ranks[rank]
        else:
            rank_zero_warn(
                f"The checkpoint holds the random states of {len(ranks)} rank(s); ranks from {len(ranks)} on keep"
                " their own, so their random draws differ from the uninterrupted run's."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:
            restore_random_state(self._pending)
            self._pending = None
