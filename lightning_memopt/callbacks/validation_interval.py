"""ValidationWithinEpoch: a validation interval in batches never longer than the epoch."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


def training_batches(trainer: Trainer) -> int | None:
    """The training batches of one epoch on this rank, after ``limit_train_batches``; ``None`` when unsized.

    Builds the training loader once more (the datamodule's or the module's ``train_dataloader()``).
    """
    source = trainer.datamodule if trainer.datamodule is not None else trainer.lightning_module
    try:
        length = len(source.train_dataloader())
    except TypeError:  # an iterable without a length
        return None
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(length, limit)
    return int(length * limit) if limit is not None else length


class ValidationWithinEpoch(Callback):
    """Clip ``Trainer(val_check_interval=k)`` (in batches) to the epoch's length, with a note.

    Lightning refuses ``val_check_interval`` larger than an epoch's training batches. A config
    default such as "validate every 20 batches" then fails on any dataset of fewer batches, about a
    setting the user never chose. This callback lowers the interval to the epoch (validation at each
    epoch's end) and says so; fractions and ``check_val_every_n_epoch=None`` are left alone.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ValidationWithinEpoch()], val_check_interval=20, logger=False)
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        interval = trainer.val_check_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or trainer.check_val_every_n_epoch is None:
            return
        batches = training_batches(trainer)
        if batches is None or not 0 < batches < interval:
            return
        trainer.val_check_interval = batches
        rank_zero_info(
            f"`val_check_interval`={interval} is longer than an epoch's {batches} training batches: validating"
            f" every {batches} batches (at the end of each epoch) instead."
        )
