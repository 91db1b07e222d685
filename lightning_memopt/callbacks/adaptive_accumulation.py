"""AdaptiveAccumulation: recover from out-of-memory by splitting the same batch, keeping the effective batch.

The callback decides when; :mod:`lightning_memopt.accumulation` does the work, without a Trainer:
:class:`~lightning_memopt.accumulation.TrainingRecovery` runs a training batch in micro-batches,
:class:`~lightning_memopt.accumulation.EvaluationChunks` an evaluation batch in chunks,
:func:`~lightning_memopt.accumulation.deliver` hands the gradients to Lightning's backward and
:func:`~lightning_memopt.accumulation.with_profile` says why the smallest micro-batch does not fit. The step
hooks are replaced through :class:`~lightning_memopt.callbacks.module_hooks.StepHooks`, and the step-keyed
schedule is a :class:`~lightning_memopt.callbacks.StepAccumulationScheduler`.
"""

from __future__ import annotations

import functools
from operator import attrgetter
from typing import Any, Literal

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from typing_extensions import override

from lightning_memopt.accumulation import (
    EvaluationChunks,
    Lockstep,
    MicroBatchSizer,
    SampleOutOfMemoryError,
    TrainingRecovery,
    deliver,
    halve,
    scaled_backward,
    with_profile,
)
from lightning_memopt.accumulation.runner import LossReduction, check_loss_reduction
from lightning_memopt.accumulation.sizing import Shrink
from lightning_memopt.arguments import check_bool, check_optional_int
from lightning_memopt.callbacks.accumulation_scheduler import AccumulationSchedule, StepAccumulationScheduler
from lightning_memopt.callbacks.module_hooks import PieceRunner, StepHooks
from lightning_memopt.distributed import max_over_ranks
from lightning_memopt.strategies import MemoptFSDPStrategy

_EVAL_STEPS = {"validate": ("validation_step",), "test": ("test_step",), "predict": ("predict_step",)}


class AdaptiveAccumulation(Callback):
    """Recover from out-of-memory errors by running the same batch in micro-batches.

    When a training step runs out of memory, the callback frees what it held and redoes the
    failed part of the batch in smaller micro-batches (halved, or ``shrink(size)``), weighting
    each micro-batch's loss by its share. The optimizer step is therefore the full batch's, and
    the effective batch, the learning-rate schedule and ``global_step`` stay as they were. No
    sample is dropped or counted twice. The size that worked is kept for later batches. It can
    grow back after ``grow_after`` steps without an error, and shrinks before failing when the
    CUDA allocator keeps retrying. Under DDP every rank runs the same micro-batches: after each
    one an all-reduce says whether any rank failed. Gradients are synchronised once per step,
    through DDP's own hooks. Validation, test and predict batches that run out of memory are
    evaluated in chunks, and the outputs are concatenated.

    Micro-batches never go below the smallest the model takes: 2 samples when it has batch-norm
    layers in training (one sample has no batch variance), else 1; a smaller ``micro_batch_size``
    is raised to it, with a warning. A model that rejects small micro-batches for another reason
    teaches its minimum when a micro-batch smaller than those that ran raises an error; the
    minimum is kept in the checkpoint.

    Micro-batches change batch-norm statistics (each sees fewer samples); a warning says so once.
    So does a module whose loss couples a batch's samples, when it says so in a
    ``batch_coupled_loss`` attribute (the face task with TopoFR's topological loss does).
    A training step's ``self.log(..., on_step=True)`` shows the last micro-batch's value, while
    ``on_epoch`` means are weighted by micro-batch size and exact. Needs automatic optimization,
    and a single-device, DDP or ``fsdp_memopt`` strategy.

    Under ``fsdp_memopt`` (:class:`~lightning_memopt.strategies.MemoptFSDPStrategy`) the
    micro-batches run as planned (``micro_batch_size``, the planner's), each reduce-scattering
    its gradients into the shards, and the allocator-retry shrink works, but an out-of-memory
    error is not recovered: every micro-batch's forward and backward are collectives (each unit's
    all-gather and reduce-scatter), so a rank that fails in the middle leaves the others waiting
    in them, and the ranks cannot realign. That rank aborts its process groups, so that the
    others' collectives fail at once instead of at their timeout, and every rank stops with a
    :class:`~lightning_memopt.accumulation.RanksOutOfStepError` naming the micro-batch size to
    resume from the last checkpoint with. Evaluation batches run whole, the same way.

    Args:
        micro_batch_size: the first micro-batch size (e.g. from the planner); ``None`` starts
            with whole batches.
        shrink: the next micro-batch size after an out-of-memory error: ``"halve"``, or a function
            ``size -> smaller size`` (on the command line its import path, e.g. ``mypackage.shrink_by_quarter``).
        grow_after: optimizer steps without an error before the micro-batch size doubles (up to
            the whole batch); ``None`` keeps the recovered size for the rest of the run.
        thrash_steps: consecutive batches in which the CUDA allocator retried that shrink the
            micro-batch before it fails; ``None``: off.
        loss_reduction: ``"mean"`` if the step's loss averages its samples, ``"sum"`` if it sums them.
        accumulate_schedule: ``{optimizer step: accumulate_grad_batches}``, e.g. ``{0: 1, 1000: 4}``: the
            convenience form of a :class:`StepAccumulationScheduler`, which this callback runs as its own part
            (its state in this callback's checkpoint entry). Each change waits for the first window boundary
            that it keeps aligned.
        evaluation: also recover validation, test and predict batches.

    Raises:
        MisconfigurationException: for a bad argument; in ``setup``, manual optimization, a
            strategy other than single-device, DDP or ``fsdp_memopt``, ``grow_after`` under
            ``fsdp_memopt``, or an ``accumulate_schedule`` together with ``Trainer(accumulate_grad_batches=...)``
            or another accumulation scheduler.
        SampleOutOfMemoryError: during training, when the smallest micro-batch the model takes
            (one sample; two with batch norm in training) does not fit. The error carries the
            memory profile of a step on that micro-batch.
        MicroBatchSizeError: during training, when a last, smaller micro-batch of a batch raised
            an error its larger ones did not: the model does not take so few samples. Later batches
            (and a resumed run) keep their micro-batches above that size.
        RanksOutOfStepError: under ``fsdp_memopt``, on every rank, after an out-of-memory error on one.

    Example::

        >>> callback = AdaptiveAccumulation(grow_after=200, accumulate_schedule={0: 1, 1000: 4})
        >>> callback.sizer.size_for(step=0, batch_size=128), callback.schedule.at(1000)
        (128, 4)
    """

    def __init__(
        self,
        micro_batch_size: int | None = None,
        shrink: Literal["halve"] | Shrink = "halve",
        grow_after: int | None = None,
        thrash_steps: int | None = 3,
        loss_reduction: LossReduction = "mean",
        accumulate_schedule: dict[int, int] | None = None,
        evaluation: bool = True,
    ) -> None:
        try:
            if not callable(shrink) and shrink != "halve":
                raise ValueError(
                    f"`shrink` must be 'halve' or a function size -> smaller size, got {shrink!r} "
                    f"({type(shrink).__name__})"
                )
            micro_batch_size = check_optional_int("micro_batch_size", micro_batch_size, minimum=1)
            grow_after = check_optional_int("grow_after", grow_after, minimum=1)
            thrash_steps = check_optional_int("thrash_steps", thrash_steps, minimum=1)
            check_loss_reduction(loss_reduction)
            self.evaluation = check_bool("evaluation", evaluation)
            self.shrink: Shrink = halve if shrink == "halve" else shrink  # type: ignore[assignment]
            self.sizer = MicroBatchSizer(micro_batch_size, self.shrink, grow_after, thrash_steps)
            schedule = AccumulationSchedule(accumulate_schedule) if accumulate_schedule is not None else None
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"AdaptiveAccumulation: {error}") from None
        self.loss_reduction = loss_reduction
        self.recovery = TrainingRecovery(self.sizer, loss_reduction)  # training batches (its state is checkpointed)
        self.chunks = EvaluationChunks(self.shrink)  # validation, test and predict batches
        self.scheduler = StepAccumulationScheduler.owned_by("AdaptiveAccumulation", "accumulate_schedule", schedule)
        self.hooks = StepHooks()
        self._batch_idx = 0  # of the batch in training: a training_step need not take `batch_idx`
        self._schedule_elsewhere = False  # a StepAccumulationScheduler of its own resumes the checkpoint's schedule

    # what the parts hold, read where they used to be: on the callback
    schedule = property(attrgetter("scheduler.schedule"), doc="The step-keyed schedule (``None``: none given).")
    learned_min_size = property(
        attrgetter("recovery.learned_min_size"), doc="The smallest micro-batch an error taught (in checkpoints)."
    )
    eval_micro_batch_size = property(
        attrgetter("chunks.micro_batch_size"), doc="The chunk size evaluation batches run in (``None``: whole)."
    )
    last_micro_batch_size = property(
        attrgetter("recovery.last_micro_batch_size"), doc="The micro-batch size the latest training batch ended with."
    )
    last_micro_batches = property(
        attrgetter("recovery.last_micro_batches"), doc="How many micro-batches the latest training batch took here."
    )

    # ---------------------------------------------------------------- setup and teardown
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        supported = SingleDeviceStrategy | DDPStrategy | MemoptFSDPStrategy
        if not isinstance(strategy, supported) or strategy.handles_gradient_accumulation:
            raise MisconfigurationException(
                "AdaptiveAccumulation works with single-device, DDP and fsdp_memopt strategies, not "
                f"{type(strategy).__name__}"
            )
        # under fsdp_memopt every micro-batch is collectives: nothing is retried, an error stops every rank
        fsdp = isinstance(strategy, MemoptFSDPStrategy)
        lockstep = Lockstep(trainer.global_rank, trainer.world_size) if fsdp else None
        if lockstep is not None and self.sizer.grow_after is not None:
            raise MisconfigurationException(
                f"AdaptiveAccumulation: `grow_after`={self.sizer.grow_after!r} under fsdp_memopt, where a micro-batch "
                "grown too large runs out of memory and stops the run (the ranks cannot realign in the middle of a "
                "step); leave `grow_after=None` and give a `micro_batch_size` that fits"
            )
        syncing = trainer.world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules())
        if syncing and lockstep is None:  # (under fsdp_memopt no error is recovered anyway)
            rank_zero_warn(
                "AdaptiveAccumulation: SyncBatchNorm runs collectives inside the forward pass. An out-of-memory error "
                "on one rank in the middle of them cannot be realigned with the other ranks: give a "
                "`micro_batch_size` known to fit (the planner's) rather than rely on recovery"
            )
        steps: tuple[str, ...] = ("validation_step",) if stage == "fit" else _EVAL_STEPS[stage]
        steps = tuple(name for name in steps if self.evaluation and is_overridden(name, pl_module))
        if stage == "fit":
            if not pl_module.automatic_optimization:
                raise MisconfigurationException(
                    "AdaptiveAccumulation needs automatic optimization: with `automatic_optimization=False` the "
                    "training_step runs its own backward and optimizer step, which the callback cannot split"
                )
            self.scheduler.setup(trainer, pl_module, stage)
            # one all-reduce per micro-batch: whether any rank failed, the smallest size that worked, ...
            agree = functools.partial(max_over_ranks, device=strategy.root_device) if trainer.world_size > 1 else None
            self.recovery.attach(pl_module, device=strategy.root_device, agree=agree, lockstep=lockstep)
            steps = ("training_step", *steps)
        self.chunks.attach(pl_module, lockstep)
        for name in steps:
            if is_param_in_hook_signature(getattr(pl_module, name), "dataloader_iter", explicit=True):
                raise MisconfigurationException(
                    f"AdaptiveAccumulation cannot split the batches of a `{name}(dataloader_iter)`: it fetches its "
                    "own batches; take `batch` instead, or leave this callback out"
                )
        for name in steps:
            run = self._train_batch(trainer, pl_module) if name == "training_step" else self._evaluation_batch(name)
            self.hooks.split(trainer, pl_module, name, run)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.hooks.restore(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")  # Lightning skips teardown hooks after an error

    # ---------------------------------------------------------------- training
    def _train_batch(self, trainer: Trainer, pl_module: LightningModule) -> PieceRunner:
        def train_batch(step: Any, batch: Any) -> Any:
            accumulate = trainer.accumulate_grad_batches
            if self._batch_idx % accumulate == 0:
                # Lightning zeroes after training_step, before backward; the micro-batches' backward comes first
                pl_module.optimizer_zero_grad(trainer.current_epoch, self._batch_idx, trainer.optimizers[0])
            backward = scaled_backward(pl_module.backward, getattr(trainer.precision_plugin, "scaler", None))
            try:
                result = self.recovery.run(step, batch, trainer.global_step, backward=backward, weight=1.0 / accumulate)
            except SampleOutOfMemoryError as error:
                precision = getattr(trainer.precision_plugin, "precision", trainer.precision)
                unwrapped = functools.partial(self.hooks.unwrapped, pl_module, "training_step")
                raise with_profile(error, pl_module, precision, unwrapped=unwrapped) from None
            return deliver(pl_module, result)

        return train_batch

    def _evaluation_batch(self, name: str) -> PieceRunner:
        return functools.partial(self.chunks.run, hook=name)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scheduler.on_train_start(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        self.scheduler.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.last_micro_batch_size is None:
            return
        pl_module.log("memopt/micro_batch_size", float(self.last_micro_batch_size), on_step=True, on_epoch=False)
        pl_module.log("memopt/oom_recoveries", float(self.sizer.oom_recoveries), on_step=True, on_epoch=False)

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        # one flat layout since the first release: the sizer's keys, eval_micro_batch_size, the schedule's, the minimum
        return {
            **self.recovery.state_dict(),
            "eval_micro_batch_size": self.chunks.micro_batch_size,
            **self.scheduler.state_dict(),
        }

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # (before load_state_dict) a checkpoint written with `accumulate_schedule` may go on in a scheduler of its own
        schedulers = (c for c in trainer.callbacks if isinstance(c, StepAccumulationScheduler))
        self._schedule_elsewhere = any(scheduler.schedule is not None for scheduler in schedulers)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state_dict)
        self.chunks.micro_batch_size = state_dict.get("eval_micro_batch_size")
        if self.schedule is not None or not self._schedule_elsewhere:  # (else that scheduler resumes it)
            self.scheduler.load_state_dict(state_dict)
