"""RandomStateCheckpoint: every rank's random number generators in the checkpoint, back on resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override


def capture_random_state() -> dict[str, Any]:
    """This process's torch (CPU and its current CUDA device), numpy and Python RNG states, as plain data.

    Plain tensors, lists and numbers: a checkpoint holding them loads with ``torch.load(weights_only=True)``.

    Example::

        >>> state = capture_random_state()
        >>> first = torch.rand(1)
        >>> restore_random_state(state)
        >>> torch.equal(torch.rand(1), first)
        True
    """
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # the current device's only: a rank draws on its own GPU, and the resuming machine may have fewer
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gauss)],
        "python": [version, list(internal), gauss_next],
    }


def restore_random_state(state: dict[str, Any]) -> None:
    """Set the generators to ``state`` from :func:`capture_random_state` (CUDA only where it was captured)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state(state["cuda"][0])
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


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
