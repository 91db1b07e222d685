"""AdaptiveAccumulation: recover from out-of-memory by splitting the same batch, keeping the effective batch."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from typing_extensions import override

from lightning_memopt.accumulation import (
    BatchSplitError,
    MicroBatchResult,
    MicroBatchRunner,
    RanksOutOfStepError,
    SampleOutOfMemoryError,
    batch_norms,
    batch_size,
    halve,
    min_micro_batch_size,
)
from lightning_memopt.accumulation.micro_batch import LossReduction, Shrink, check_loss_reduction, with_loss
from lightning_memopt.accumulation.schedule import AccumulationSchedule
from lightning_memopt.accumulation.sizing import MicroBatchSizer
from lightning_memopt.arguments import check_bool, check_optional_int
from lightning_memopt.memory.allocator import allocator_retries
from lightning_memopt.memory.oom import is_oom_error
from lightning_memopt.memory.profile import profile_step
from lightning_memopt.strategies import MemoptFSDPStrategy
from lightning_memopt.vocabulary import PROFILE_PRECISIONS

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
        accumulate_schedule: ``{optimizer step: accumulate_grad_batches}``, e.g. ``{0: 1, 1000: 4}``.
            Each change waits for the first window boundary that it keeps aligned.
        evaluation: also recover validation, test and predict batches.

    Raises:
        MisconfigurationException: for a bad argument; in ``setup``, manual optimization, a
            strategy other than single-device, DDP or ``fsdp_memopt``, ``grow_after`` under
            ``fsdp_memopt``, or an ``accumulate_schedule`` together with ``Trainer(accumulate_grad_batches=...)``.
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
            self.schedule = AccumulationSchedule(accumulate_schedule) if accumulate_schedule is not None else None
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"AdaptiveAccumulation: {error}") from None
        self.loss_reduction = loss_reduction
        self.eval_micro_batch_size: int | None = None
        self.last_micro_batch_size: int | None = None  # the size the latest training batch ended with
        self.last_micro_batches = 0  # how many micro-batches it took on this rank
        self._originals: dict[str, Any] = {}  # hook name -> the instance attribute it replaced (or _ABSENT)
        self._train_runner: MicroBatchRunner | None = None
        self._eval_runner: MicroBatchRunner | None = None
        self._warned_batch_norm = self._warned_coupled_loss = self._warned_min_size = False
        self.learned_min_size: int | None = None  # taught by an error on a small micro-batch (saved in checkpoints)
        self._learned_reason: str | None = None
        self._norms: list[nn.Module] | None = None  # the module's batch norms, listed at its first batch
        self._allocator_retries = 0
        self._batch_idx = 0  # of the batch in training: a training_step need not take `batch_idx`
        self._accumulate: int | None = None  # accumulate_grad_batches the schedule set (saved in checkpoints)
        self._lockstep = False  # under fsdp_memopt: every micro-batch is collectives, nothing is retried

    # ---------------------------------------------------------------- setup and teardown
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self._norms = None  # listed again at this run's first batch
        supported = SingleDeviceStrategy | DDPStrategy | MemoptFSDPStrategy
        if not isinstance(strategy, supported) or strategy.handles_gradient_accumulation:
            raise MisconfigurationException(
                "AdaptiveAccumulation works with single-device, DDP and fsdp_memopt strategies, not "
                f"{type(strategy).__name__}"
            )
        self._lockstep = isinstance(strategy, MemoptFSDPStrategy)
        if self._lockstep and self.sizer.grow_after is not None:
            raise MisconfigurationException(
                f"AdaptiveAccumulation: `grow_after`={self.sizer.grow_after!r} under fsdp_memopt, where a micro-batch "
                "grown too large runs out of memory and stops the run (the ranks cannot realign in the middle of a "
                "step); leave `grow_after=None` and give a `micro_batch_size` that fits"
            )
        syncing = trainer.world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules())
        if syncing and not self._lockstep:  # (under fsdp_memopt no error is recovered anyway)
            rank_zero_warn(
                "AdaptiveAccumulation: SyncBatchNorm runs collectives inside the forward pass. An out-of-memory error "
                "on one rank in the middle of them cannot be realigned with the other ranks: give a "
                "`micro_batch_size` known to fit (the planner's) rather than rely on recovery"
            )
        steps: tuple[str, ...] = ("validation_step",) if stage == "fit" else _EVAL_STEPS[stage]
        steps = tuple(name for name in steps if self.evaluation and is_overridden(name, pl_module))
        if stage == "fit":
            self._check_fit(trainer, pl_module)
            agree = self._agree_across_ranks(strategy.root_device) if trainer.world_size > 1 else None
            self._train_runner = MicroBatchRunner(
                pl_module, self.shrink, self.loss_reduction, agree, lockstep=self._lockstep
            )
            self._set_min_size(self._train_runner, pl_module)
            self._allocator_retries = allocator_retries(strategy.root_device)
            steps = ("training_step", *steps)
        self._eval_runner = MicroBatchRunner(pl_module, self.shrink)
        for name in steps:
            if is_param_in_hook_signature(getattr(pl_module, name), "dataloader_iter", explicit=True):
                raise MisconfigurationException(
                    f"AdaptiveAccumulation cannot split the batches of a `{name}(dataloader_iter)`: it fetches its "
                    "own batches; take `batch` instead, or leave this callback out"
                )
        for name in steps:
            wrapper = self._training_step if name == "training_step" else self._evaluation_step
            self._install(pl_module, name, wrapper(trainer, pl_module, name))

    def _check_fit(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "AdaptiveAccumulation needs automatic optimization: with `automatic_optimization=False` the "
                "training_step runs its own backward and optimizer step, which the callback cannot split"
            )
        if self.schedule is not None and trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"AdaptiveAccumulation: `accumulate_schedule`={self.schedule.describe()} and "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) both set the accumulation; "
                "give it in one place"
            )

    def _set_min_size(self, runner: MicroBatchRunner, pl_module: nn.Module, cached: bool = False) -> None:
        """The smallest micro-batch the module takes as it is now (or as an error taught), for the runner and sizer.

        ``cached``: read the modes of the batch norms listed at the first batch (after ``configure_model``
        has built every layer) instead of walking the module again, as every step does.
        """
        if cached and self._norms is None:
            self._norms = batch_norms(pl_module)
        size, reason = min_micro_batch_size(pl_module, self._norms if cached else None)
        learned = [(runner.learned_min_size, runner.learned_min_size_reason)]
        if runner is self._train_runner:  # (what training taught, evaluation in eval mode need not keep)
            learned.append((self.learned_min_size, self._learned_reason))
        for least, why in learned:
            if least is not None and least > size:
                size, reason = least, why
        runner.min_size, runner.min_size_reason = size, reason
        if runner is not self._train_runner:
            return
        self.sizer.min_size = size
        if self.sizer.size is not None and self.sizer.size < size:
            if not self._warned_min_size:
                self._warned_min_size = True
                rank_zero_warn(
                    f"AdaptiveAccumulation: micro-batches of {self.sizer.size} are raised to {size}, the smallest the "
                    f"model takes: {reason}"
                )
            self.sizer.size = size

    def _learned_from(self, runner: MicroBatchRunner) -> None:
        """Keep the minimum the runner learned from an error (for later batches and the checkpoint)."""
        learned = runner.learned_min_size
        if learned is not None and learned > (self.learned_min_size or 0):
            self.learned_min_size, self._learned_reason = learned, runner.learned_min_size_reason
            self.sizer.min_size = max(self.sizer.min_size, learned)

    @staticmethod
    def _agree_across_ranks(device: torch.device) -> Callable[[list[int]], list[int]]:
        def agree(values: list[int]) -> list[int]:
            flags = torch.tensor(values, dtype=torch.int64, device=device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)  # one collective, no barrier
            return flags.tolist()

        return agree

    def _install(self, pl_module: LightningModule, name: str, hook: Callable[..., Any]) -> None:
        if name not in self._originals:
            self._originals[name] = pl_module.__dict__.get(name, _ABSENT)
        setattr(pl_module, name, hook)

    def _uninstall(self, pl_module: LightningModule, name: str) -> None:
        previous = self._originals.pop(name)
        if previous is _ABSENT:
            pl_module.__dict__.pop(name, None)
        else:
            setattr(pl_module, name, previous)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for name in list(self._originals):
            self._uninstall(pl_module, name)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")  # Lightning skips teardown hooks after an error

    # ---------------------------------------------------------------- training
    def _training_step(self, trainer: Trainer, pl_module: LightningModule, name: str) -> Callable[..., Any]:
        original = pl_module.training_step

        @functools.wraps(original)  # Lightning reads the signature (is `batch_idx` taken?) and the override
        def training_step(*args: Any, **kwargs: Any) -> Any:
            batch = args[0] if args else kwargs["batch"]
            return self._train_batch(trainer, pl_module, _on_chunks(trainer, original, args, kwargs), batch)

        return training_step

    def _train_batch(self, trainer: Trainer, pl_module: LightningModule, step: Callable[[Any], Any], batch: Any) -> Any:
        assert self._train_runner is not None
        accumulate = trainer.accumulate_grad_batches
        if self._batch_idx % accumulate == 0:
            # Lightning zeroes after training_step, before backward; the micro-batches' backward comes first
            pl_module.optimizer_zero_grad(trainer.current_epoch, self._batch_idx, trainer.optimizers[0])
        self._set_min_size(self._train_runner, pl_module, cached=True)  # batch norms may have been frozen since
        total = _size_or_none(batch)  # None: a batch that cannot be split runs whole
        size = None if total is None else self.sizer.size_for(trainer.global_step, total)
        if total is not None and size is not None:
            self._warn_batch_coupling(pl_module, size, total)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        try:
            with self._stop_every_rank_on_error(trainer, "training_step", size, total):
                result = self._train_runner.run(
                    step,
                    batch,
                    size,
                    backward=lambda loss: _backward(pl_module, loss, scaler),
                    weight=1.0 / accumulate,
                    flags=[self._allocator_retried_since_last_batch(trainer)],
                )
        except SampleOutOfMemoryError as error:
            raise self._with_profile(error, trainer, pl_module) from None
        finally:
            _attach_batch(trainer, batch)
            self._learned_from(self._train_runner)
        if total is None:  # ran whole (another rank's recovery cannot change that)
            return _deliver(pl_module, result)
        if result.recovered:
            self.sizer.recovered(trainer.global_step, result.micro_batch_size)
            self._allocator_retries = allocator_retries(trainer.strategy.root_device)  # the OOM's own retries
            self._warn_batch_coupling(pl_module, result.micro_batch_size, total)
            cause = f" ({result.oom_errors[0][:160]})" if result.oom_errors else " on another rank"
            rank_zero_info(
                f"AdaptiveAccumulation: out of memory at step {trainer.global_step} with micro-batches of {size}"
                f"{cause}; the batch of {total} ran in micro-batches of {result.micro_batch_size} "
                f"({len(result.sizes)} on this rank) and the optimizer step is unchanged"
            )
        elif self.sizer.allocator_retried(bool(result.flags[0]), trainer.global_step, total):
            rank_zero_info(
                f"AdaptiveAccumulation: the CUDA allocator retried in {self.sizer.thrash_steps} batches in a row; "
                f"micro-batches of {self.sizer.size} from step {trainer.global_step}, before it runs out of memory"
            )
        self.last_micro_batch_size = min(result.micro_batch_size, total)
        self.last_micro_batches = len(result.sizes)
        return _deliver(pl_module, result)

    @contextlib.contextmanager
    def _stop_every_rank_on_error(
        self, trainer: Trainer, hook: str, size: int | None, total: int | None
    ) -> Iterator[None]:
        """Under fsdp_memopt, an error in the middle of a step stops every rank at once, saying how to resume.

        The rank that fails aborts its process groups, so that the others' pending collectives fail
        now instead of at their timeout; an out-of-memory error there, and the failed collective on
        the other ranks, become a :class:`RanksOutOfStepError`. ``size`` and ``total``: the
        micro-batch and batch sizes of the step (``None``: whole, a batch that cannot be split).
        """
        try:
            yield
        except Exception as error:
            if not self._lockstep:
                raise
            if trainer.world_size > 1:
                _abort_process_groups()
            stopped = self._out_of_step(error, trainer, hook, size, total)
            if stopped is None:
                raise
            raise stopped from error

    def _out_of_step(
        self, error: Exception, trainer: Trainer, hook: str, size: int | None, total: int | None
    ) -> RanksOutOfStepError | None:
        """What every rank stops with after ``error``: this rank's out-of-memory error, or another rank's leaving."""
        oom = is_oom_error(error)
        if not oom and not _collective_failed(error):
            return None
        rank = trainer.global_rank
        batches = _batches(size, total)
        if hook == "training_step":
            where = f"at step {trainer.global_step} with {batches}"
            resume = self._resume_size(size)
            advice = (
                f"resume from the last checkpoint with AdaptiveAccumulation(micro_batch_size={resume}), or plan the "
                "run (memopt=planned)"
                if resume is not None
                else "lower the memory per sample (ActivationCheckpointing, PrecisionSwitch('auto'), "
                "MemoptFSDPStrategy(cpu_offload=True)) and resume from the last checkpoint"
            )
        else:
            where, resume = f"in {hook} with {batches}", None
            advice = f"give the {hook.removesuffix('_step')} dataloader smaller batches"
        if oom:
            cause = f"{type(error).__name__}: {str(error)[:160]}"
            what = f"out of memory on rank {rank} {where} under fsdp_memopt ({cause})"
            then = f"To go on, {advice}."
        else:
            what = f"a collective failed on rank {rank} {where} under fsdp_memopt: another rank stopped in the middle"
            then = f"That rank's error says why; after an out-of-memory error there, {advice}."
        return RanksOutOfStepError(
            f"AdaptiveAccumulation: {what}. The ranks cannot realign in the middle of a step (its forward and backward "
            f"passes are collectives: each unit's all-gather and reduce-scatter), so every rank stops. {then}",
            rank,
            size,
            resume,
        )

    def _resume_size(self, size: int | None) -> int | None:
        """The micro-batch size to resume with after ``size`` ran out of memory (``None``: none smaller is taken)."""
        least = self.sizer.min_size
        if size is None or size <= least:
            return None
        return max(self.shrink(size), least)

    def _allocator_retried_since_last_batch(self, trainer: Trainer) -> int:
        if self.sizer.thrash_steps is None:
            return 0
        retries = allocator_retries(trainer.strategy.root_device)
        retried, self._allocator_retries = retries > self._allocator_retries, retries
        return int(retried)

    def _warn_batch_coupling(self, pl_module: LightningModule, size: int, total: int) -> None:
        """Warn once each: micro-batches change batch-norm statistics, and a loss over the batch's samples."""
        if size >= total:
            return
        layers = [type(m).__name__ for m in pl_module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if layers and not self._warned_batch_norm:
            self._warned_batch_norm = True
            rank_zero_warn(
                f"AdaptiveAccumulation: micro-batches of {size} (of {total}) change the batch statistics of the "
                f"model's {len(layers)} batch-norm layers ({', '.join(sorted(set(layers)))}). Ghost batch norm or "
                "GroupNorm / LayerNorm keep them independent of the micro-batch size; SyncBatchNorm pools every "
                "rank's micro-batch (under DDP, with a `micro_batch_size` that fits: see docs/guide/accumulation.md)"
            )
        coupled = getattr(pl_module, "batch_coupled_loss", None)
        if coupled and not self._warned_coupled_loss:
            self._warned_coupled_loss = True
            rank_zero_warn(
                f"AdaptiveAccumulation: micro-batches of {size} (of {total}) change {coupled}: it couples the "
                "samples of a batch, so each micro-batch is a batch of its own to it. Give a batch that fits, "
                "or accept a loss computed on the smaller batches"
            )

    def _with_profile(
        self, error: SampleOutOfMemoryError, trainer: Trainer, pl_module: LightningModule
    ) -> SampleOutOfMemoryError:
        """The error again, with a fake-mode memory profile of a training step on the failing micro-batch."""
        if error.sample is None or any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules()):
            return error  # (a SyncBatchNorm forward would wait for ranks that have stopped)
        precision = getattr(trainer.precision_plugin, "precision", trainer.precision)
        precision = precision if precision in PROFILE_PRECISIONS else "32-true"
        try:
            with _disable_current_modes(), self._unwrapped(pl_module, "training_step"):
                profile = profile_step(pl_module, error.sample, mode="fake", precision=precision)
        except Exception as failure:  # the profile is a diagnosis: its own failure must not hide the OOM
            return SampleOutOfMemoryError(
                f"{error}\n(no memory profile: {type(failure).__name__}: {failure})", error.sample, size=error.size
            )
        what = {1: "that one sample", None: "that batch"}.get(error.size, f"those {error.size} samples")
        return SampleOutOfMemoryError(
            f"{error}\nA training step on {what}, predicted in fake mode:\n{profile.table()}\n"
            "Lower the memory per sample: ActivationCheckpointing, PrecisionSwitch('auto'), a smaller input or model",
            error.sample,
            profile,
            size=error.size,
        )

    @contextlib.contextmanager
    def _unwrapped(self, pl_module: LightningModule, name: str) -> Iterator[None]:
        hook = pl_module.__dict__[name]
        self._uninstall(pl_module, name)
        try:
            yield
        finally:
            self._install(pl_module, name, hook)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.schedule is not None and self._accumulate is not None:
            trainer.accumulate_grad_batches = self._accumulate  # as the checkpoint's run had it

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        if self.schedule is None or batch_idx % trainer.accumulate_grad_batches:
            return
        wanted = self.schedule.at(trainer.global_step)
        if wanted != trainer.accumulate_grad_batches and batch_idx % wanted == 0:  # windows stay aligned
            rank_zero_info(
                f"AdaptiveAccumulation: accumulate_grad_batches {trainer.accumulate_grad_batches} -> {wanted} "
                f"at step {trainer.global_step}"
            )
            trainer.accumulate_grad_batches = wanted
        self._accumulate = trainer.accumulate_grad_batches

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.last_micro_batch_size is None:
            return
        pl_module.log("memopt/micro_batch_size", float(self.last_micro_batch_size), on_step=True, on_epoch=False)
        pl_module.log("memopt/oom_recoveries", float(self.sizer.oom_recoveries), on_step=True, on_epoch=False)

    # ---------------------------------------------------------------- evaluation
    def _evaluation_step(self, trainer: Trainer, pl_module: LightningModule, name: str) -> Callable[..., Any]:
        original = getattr(pl_module, name)

        @functools.wraps(original)
        def evaluation_step(*args: Any, **kwargs: Any) -> Any:
            assert self._eval_runner is not None
            self._set_min_size(self._eval_runner, pl_module, cached=True)  # in eval mode: batch norm takes one sample
            batch = args[0] if args else kwargs["batch"]
            total = _size_or_none(batch)
            if self._lockstep:  # whole batches: chunks after an error would leave the ranks out of step
                with self._stop_every_rank_on_error(trainer, name, None, total):
                    return original(*args, **kwargs)
            size = None if total is None or self.eval_micro_batch_size is None else self.eval_micro_batch_size
            try:
                result = self._eval_runner.run(_on_chunks(trainer, original, args, kwargs), batch, size)
            finally:
                _attach_batch(trainer, batch)
            if result.recovered:
                self.eval_micro_batch_size = result.micro_batch_size
                rank_zero_info(
                    f"AdaptiveAccumulation: out of memory in {name}; batches of {total} are evaluated in chunks of "
                    f"{result.micro_batch_size} from now on"
                )
            return result.output

        return evaluation_step

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.sizer.state_dict(),
            "eval_micro_batch_size": self.eval_micro_batch_size,
            "accumulate_schedule": self.schedule.describe() if self.schedule else None,
            "accumulate_grad_batches": self._accumulate,
            "learned_min_size": self.learned_min_size,
            "learned_min_size_reason": self._learned_reason,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sizer.load_state_dict(state_dict)
        self.eval_micro_batch_size = state_dict.get("eval_micro_batch_size")
        self._accumulate = state_dict.get("accumulate_grad_batches")
        self.learned_min_size = state_dict.get("learned_min_size")  # (absent from older checkpoints)
        self._learned_reason = state_dict.get("learned_min_size_reason")
        if self._train_runner is not None:  # restored after setup: the runner and sizer take it now
            self._set_min_size(self._train_runner, self._train_runner.module)
        saved = state_dict.get("accumulate_schedule")
        current = self.schedule.describe() if self.schedule else None
        if saved != current:
            rank_zero_warn(
                f"AdaptiveAccumulation: resuming with accumulate_schedule {current!r}; the checkpoint was written "
                f"under {saved!r}"
            )


_ABSENT = object()


class _DeliverGradients(torch.autograd.Function):
    """Forward: the batch's loss, detached. Backward: the gradients the micro-batches accumulated.

    Lightning's own backward on this output hands every parameter its gradient. That lets DDP's
    reducer all-reduce it once per step, and it runs the backward hooks once per batch. Under
    FSDP each micro-batch's backward has reduce-scattered its gradients already: the sharded
    gradients (DTensors) are handed back as they are. The gradients already carry the loss
    weights and the gradient scaler's scale, so the incoming gradient (``scale /
    accumulate_grad_batches``) is not applied to them again.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, gradients: list[torch.Tensor], *parameters: torch.Tensor) -> torch.Tensor:
        ctx.gradients = gradients
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gradients, ctx.gradients = ctx.gradients, None  # let autograd move them into .grad without a copy
        result = (None, None, *gradients)
        gradients.clear()
        return result


def _deliver(pl_module: LightningModule, result: MicroBatchResult) -> Any:
    """The step's output for Lightning, its loss carrying the accumulated gradients to Lightning's backward."""
    if result.loss is None:
        return result.output
    parameters = [p for p in pl_module.parameters() if p.requires_grad and p.grad is not None]
    gradients = [p.grad for p in parameters]
    for parameter in parameters:
        parameter.grad = None  # Lightning's zero_grad, which runs before its backward, finds nothing to clear
    return with_loss(result.output, _DeliverGradients.apply(result.loss, gradients, *parameters))


def _backward(pl_module: LightningModule, loss: torch.Tensor, scaler: Any) -> None:
    # outside the training step's autocast, as Lightning runs its backward; through the module's `backward` hook
    with torch.autocast(loss.device.type, enabled=False):
        pl_module.backward(scaler.scale(loss) if scaler is not None else loss)


def _batches(size: int | None, total: int | None) -> str:
    if total is None:
        return "a batch that cannot be split"
    if size is None or size >= total:
        return f"whole batches of {total}"
    return f"micro-batches of {size} (of {total})"


def _collective_failed(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank left: torch's typed errors, gloo's messages."""
    return isinstance(error, torch.distributed.DistError) or "/gloo/" in str(error)


def _abort_process_groups() -> None:
    """Abort this rank's process groups: the other ranks' pending collectives fail now, not at their timeout.

    With gloo their sends and receives fail as soon as the connections close (within a second on the
    CPU). NCCL communicators are aborted rather than flushed; a peer blocked in a kernel stops when
    its watchdog or the launcher (torchrun, Lightning's) ends it, at the latest at the ``timeout``.
    """
    # private API: the public destroy_process_group() flushes pending NCCL collectives first, which would wait for
    # the ones the other ranks never join; there is no public abort
    from torch.distributed.distributed_c10d import _abort_process_group

    if torch.distributed.is_initialized():
        _abort_process_group()


def _size_or_none(batch: Any) -> int | None:
    try:
        return batch_size(batch)
    except BatchSplitError:
        return None  # it runs whole; only an out-of-memory error on it is an error


def _attach_batch(trainer: Trainer, batch: Any) -> None:
    """Point Lightning's logging at ``batch``: ``self.log`` weighs its ``on_epoch`` means by that batch's size."""
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.batch, results.batch_size = batch, None


def _on_chunks(
    trainer: Trainer, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[Any], Any]:
    """``step`` called as Lightning called it, with a micro-batch in place of the batch (and logged as one)."""

    def on_chunk(chunk: Any) -> Any:
        _attach_batch(trainer, chunk)
        if args:
            return step(chunk, *args[1:], **kwargs)
        return step(**{**kwargs, "batch": chunk})

    return on_chunk
