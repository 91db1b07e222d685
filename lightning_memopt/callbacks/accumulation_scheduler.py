"""StepAccumulationScheduler: ``accumulate_grad_batches`` by optimizer step (Lightning's scheduler goes by epoch).

:class:`AccumulationSchedule` is the schedule itself, which :class:`~lightning_memopt.AdaptiveAccumulation`'s
``accumulate_schedule`` also reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override


class AccumulationSchedule:
    """``accumulate_grad_batches`` from a given optimizer step on (Lightning's own scheduler goes by epoch).

    Steps before the first entry accumulate 1 batch.

    Args:
        entries: ``{first optimizer step: batches per step}``, e.g. ``{0: 1, 1000: 4}``.
        name: the argument the entries came from, for the error messages.

    Raises:
        ValueError: for an empty schedule, a step that is not an int ≥ 0, or a count that is not an int ≥ 1.

    Example::

        >>> schedule = AccumulationSchedule({0: 1, 1000: 4, 5000: 8})
        >>> schedule.at(999), schedule.at(1000), schedule.at(10**6)
        (1, 4, 8)
        >>> schedule.describe()
        '{0: 1, 1000: 4, 5000: 8}'
    """

    def __init__(self, entries: Mapping[Any, Any], name: str = "accumulate_schedule") -> None:
        if not isinstance(entries, Mapping) or not entries:
            raise ValueError(f"`{name}`={entries!r} must be a non-empty {{step: batches}} mapping")
        parsed: dict[int, int] = {}
        for step, count in entries.items():
            step_value, count_value = _as_int(step), _as_int(count)
            if step_value is None or step_value < 0:
                raise ValueError(f"`{name}` step {step!r} must be an int ≥ 0")
            if count_value is None or count_value < 1:
                raise ValueError(f"`{name}`[{step!r}]={count!r} must be an int ≥ 1 (batches per step)")
            parsed[step_value] = count_value
        self.entries = dict(sorted(parsed.items()))

    def at(self, step: int) -> int:
        """Batches accumulated by the optimizer step ``step``."""
        count = 1
        for start, value in self.entries.items():
            if start > step:
                break
            count = value
        return count

    def describe(self) -> str:
        """The schedule as ``{step: batches, ...}`` (what checkpoints keep, to compare with a resumed run's)."""
        return "{" + ", ".join(f"{step}: {count}" for step, count in self.entries.items()) + "}"


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():  # Hydra/YAML may give keys as strings
        return int(value)
    return None


# the state key of the callback that held the schedule before it was a callback of its own
_FORMER_OWNER = "AdaptiveAccumulation"


class StepAccumulationScheduler(Callback):
    """Change ``accumulate_grad_batches`` at given optimizer steps: the step-keyed sibling of Lightning's scheduler.

    Lightning's ``GradientAccumulationScheduler`` changes the accumulation when an epoch starts;
    this one when the optimizer step of a ``scheduling`` entry is reached. A change waits for the
    first batch that starts an accumulation window under both counts (its index in the epoch a
    multiple of the new count), so no window is cut short and every batch is counted once. The
    count in force is kept in checkpoints: a resumed run goes on with it. A checkpoint of
    ``AdaptiveAccumulation(accumulate_schedule=...)`` (which held the schedule before this callback
    existed) resumes here too.

    ``AdaptiveAccumulation(accumulate_schedule=...)`` owns one of these, the convenience form.

    Args:
        scheduling: ``{optimizer step: accumulate_grad_batches}``, e.g. ``{0: 1, 1000: 4}``; steps before
            the first entry accumulate 1 batch. ``None`` leaves the accumulation to the Trainer.

    Raises:
        MisconfigurationException: for a bad ``scheduling``; in ``setup``, together with
            ``Trainer(accumulate_grad_batches=...)`` or another accumulation scheduler, under manual
            optimization, or with a strategy that accumulates gradients itself (DeepSpeed).

    Example::

        >>> scheduler = StepAccumulationScheduler({0: 1, 1000: 4})
        >>> scheduler.schedule.at(999), scheduler.schedule.at(1000)
        (1, 4)
    """

    def __init__(self, scheduling: dict[int, int] | None = None) -> None:
        self._owner, self._argument = "StepAccumulationScheduler", "scheduling"
        try:
            self.schedule = AccumulationSchedule(scheduling, self._argument) if scheduling is not None else None
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"{self._owner}: {error}") from None
        self._accumulate: int | None = None  # accumulate_grad_batches the schedule set (saved in checkpoints)

    @classmethod
    def owned_by(cls, owner: str, argument: str, schedule: AccumulationSchedule | None) -> StepAccumulationScheduler:
        """A scheduler that another callback (``owner``, given the schedule as ``argument``) runs as its own part."""
        scheduler = cls()
        scheduler._owner, scheduler._argument, scheduler.schedule = owner, argument, schedule
        return scheduler

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.schedule is None:
            return
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"{self._owner}: Lightning accumulates no gradients under `automatic_optimization=False`; "
                f"leave `{self._argument}` out, or accumulate in your training_step"
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise MisconfigurationException(
                f"{self._owner}: {type(trainer.strategy).__name__} accumulates gradients itself; set its own "
                "accumulation instead"
            )
        setters = [f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})"]
        setters = setters if trainer.accumulate_grad_batches != 1 else []
        setters += [type(c).__name__ for c in trainer.callbacks if _schedules(c) and self not in (c, _owned(c))]
        if setters:
            raise MisconfigurationException(
                f"{self._owner}: `{self._argument}`={self.schedule.describe()} and {setters[0]} both set the "
                "accumulation; give it in one place"
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.schedule is not None and self._accumulate is not None:
            trainer.accumulate_grad_batches = self._accumulate  # as the checkpoint's run had it

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.schedule is None or batch_idx % trainer.accumulate_grad_batches:
            return
        wanted = self.schedule.at(trainer.global_step)
        if wanted != trainer.accumulate_grad_batches and batch_idx % wanted == 0:  # windows stay aligned
            rank_zero_info(
                f"{self._owner}: accumulate_grad_batches {trainer.accumulate_grad_batches} -> {wanted} "
                f"at step {trainer.global_step}"
            )
            trainer.accumulate_grad_batches = wanted
        self._accumulate = trainer.accumulate_grad_batches

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written while AdaptiveAccumulation held the schedule: take its state (before load_state_dict)
        states = checkpoint.get("callbacks") or {}
        former = states.get(_FORMER_OWNER)
        if self.state_key not in states and isinstance(former, dict) and former.get("accumulate_schedule"):
            self.load_state_dict(former)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "accumulate_schedule": self.schedule.describe() if self.schedule else None,
            "accumulate_grad_batches": self._accumulate,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._accumulate = state_dict.get("accumulate_grad_batches")
        saved = state_dict.get("accumulate_schedule")
        current = self.schedule.describe() if self.schedule else None
        if saved != current:
            rank_zero_warn(
                f"{self._owner}: resuming with {self._argument} {current!r}; the checkpoint was written under {saved!r}"
            )


def _owned(callback: Callback) -> StepAccumulationScheduler | None:
    """The scheduler ``callback`` runs as its own part (``AdaptiveAccumulation(accumulate_schedule=...)``'s), if any."""
    scheduler = getattr(callback, "scheduler", None)
    return scheduler if isinstance(scheduler, StepAccumulationScheduler) else None


def _schedules(callback: Callback) -> bool:
    """Whether ``callback`` sets the accumulation: Lightning's scheduler, or a step scheduler with a schedule."""
    if isinstance(callback, GradientAccumulationScheduler):
        return True
    scheduler = callback if isinstance(callback, StepAccumulationScheduler) else _owned(callback)
    return scheduler is not None and scheduler.schedule is not None
