"""What a run needs to resume exactly: ``last.ckpt`` at every fit's end and on Ctrl-C (:class:`LastCheckpoint`), and
every rank's random generators in each checkpoint (:class:`RandomStateCheckpoint`)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_path
from lightning_memopt.random_generators import capture_random_state, restore_random_state


class LastCheckpoint(Callback):
    """Write ``dirpath/filename`` when a fit ends, however short; stop at a step boundary on Ctrl-C and write it too.

    Lightning's ``ModelCheckpoint`` saves on its own schedule (validation, epochs), so a short run,
    or one stopped early, can leave nothing to resume from. This callback saves after the last step
    of every fit that ends normally (``max_steps``, ``max_epochs``, early stopping). With
    ``on_interrupt``, the first Ctrl-C (SIGINT) asks every rank to stop after the optimizer step in
    progress — the checkpoint then lies on a step boundary, so resuming from it is exact — and the
    second stops at once, as without the callback. :attr:`interrupted` tells whether the fit was stopped that way.

    Args:
        dirpath: the folder; ``None`` means ``<trainer.default_root_dir>/checkpoints``.
        filename: the file name, ``last.ckpt`` by default.
        on_interrupt: catch the first Ctrl-C in the main thread and stop gracefully.

    Raises:
        TypeError: ``dirpath`` or ``filename`` is not a path.
        ValueError: ``on_interrupt`` is not a boolean.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[LastCheckpoint("checkpoints")], logger=False, enable_progress_bar=False)
    """

    def __init__(
        self, dirpath: str | os.PathLike[str] | None = None, filename: str = "last.ckpt", on_interrupt: bool = True
    ) -> None:
        self.dirpath = None if dirpath is None else check_path("dirpath", dirpath)
        self.filename = check_path("filename", filename)
        self.on_interrupt = check_bool("on_interrupt", on_interrupt)
        self.interrupted = False
        self._stop_requested = False
        self._saved_step: int | None = None
        self._previous_handler: Any = None

    @property
    def stop_requested(self) -> bool:
        """Whether Ctrl-C was pressed during the fit (once: a graceful stop; twice: Lightning stopped at once)."""
        return self._stop_requested

    def path(self, trainer: Trainer) -> str:
        """Where the checkpoint goes for ``trainer``."""
        dirpath = self.dirpath if self.dirpath is not None else os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(dirpath, self.filename)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.interrupted = self._stop_requested = False
        self._saved_step: int | None = None
        if self.on_interrupt and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGINT, self._request_stop)

    def _request_stop(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_requested:  # the second Ctrl-C: stop now
            self._restore_handler()
            raise KeyboardInterrupt
        self._stop_requested = True
        print(
            "\nCtrl-C: stopping after this step and saving the last checkpoint (Ctrl-C again to stop now)", flush=True
        )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Only after an optimizer step: a stop mid-accumulation would lose the gradients gathered so far.
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last_batch
        if self.on_interrupt and stepped:
            stop = self._stop_requested
            if trainer.world_size > 1:  # ranks stop together, after the same step
                stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
            if stop:
                self.interrupted = True
                trainer.should_stop = True
        if stepped and (self.interrupted or trainer.global_step == trainer.max_steps):
            # Saved here, on the step boundary: by `on_train_end` Lightning has counted the epoch in progress
            # as finished, and a run resumed from there would skip the rest of it.
            self._save(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handler()
        if self._saved_step != trainer.global_step:  # ended by `max_epochs` or early stopping: an epoch boundary
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        path = self.path(trainer)
        trainer.save_checkpoint(path)
        self._saved_step = trainer.global_step
        rank_zero_info(f"Saved the last checkpoint: {path}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None


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
