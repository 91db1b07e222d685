"""AdaptiveAccumulation: recover from out-of-memory by splitting the same batch, keeping the effective batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from typing_extensions import override

from lightning_memopt.accumulation import (
    LOSS_REDUCTIONS,
    MicroBatchResult,
    MicroBatchRunner,
    SampleOutOfMemoryError,
    batch_size,
    halve,
)
from lightning_memopt.accumulation.micro_batch import Shrink
from lightning_memopt.accumulation.schedule import AccumulationSchedule
from lightning_memopt.accumulation.sizing import MicroBatchSizer
from lightning_memopt.memory.allocator import allocator_retries
from lightning_memopt.memory.profile import PRECISIONS, profile_step

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

    Micro-batches change batch-norm statistics (each sees fewer samples); a warning says so once.
    A training step's ``self.log(..., on_step=True)`` shows the last micro-batch's value, while
    ``on_epoch`` means are weighted by micro-batch size and exact. Needs automatic optimization,
    and a single-device or DDP strategy.

    Args:
        micro_batch_size: the first micro-batch size (e.g. from the planner); ``None`` starts
            with whole batches.
        shrink: ``"halve"`` or ``size -> smaller size`` after an out-of-memory error.
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
            strategy other than single-device or DDP, or an ``accumulate_schedule`` together with
            ``Trainer(accumulate_grad_batches=...)``.
        SampleOutOfMemoryError: during training, when one sample alone does not fit. The error
            carries the memory profile of a step on that sample.

    Example::

        >>> callback = AdaptiveAccumulation(grow_after=200, accumulate_schedule={0: 1, 1000: 4})
        >>> callback.sizer.size_for(step=0, batch_size=128), callback.schedule.at(1000)
        (128, 4)
    """

    def __init__(
        self,
        micro_batch_size: int | None = None,
        shrink: str | Shrink = "halve",
        grow_after: int | None = None,
        thrash_steps: int | None = 3,
        loss_reduction: str = "mean",
        accumulate_schedule: dict[int, int] | None = None,
        evaluation: bool = True,
    ) -> None:
        if shrink != "halve" and not callable(shrink):
            raise MisconfigurationException(
                f"AdaptiveAccumulation: `shrink`={shrink!r} must be 'halve' or a function size -> smaller size"
            )
        if loss_reduction not in LOSS_REDUCTIONS:
            raise MisconfigurationException(
                f"AdaptiveAccumulation: unknown `loss_reduction`={loss_reduction!r}; "
                f"valid choices: {', '.join(LOSS_REDUCTIONS)}"
            )
        self.shrink: Shrink = halve if shrink == "halve" else shrink  # type: ignore[assignment]
        try:
            self.sizer = MicroBatchSizer(micro_batch_size, self.shrink, grow_after, thrash_steps)
            self.schedule = AccumulationSchedule(accumulate_schedule) if accumulate_schedule is not None else None
        except ValueError as error:
            raise MisconfigurationException(f"AdaptiveAccumulation: {error}") from None
        self.loss_reduction = loss_reduction
        self.evaluation = evaluation
        self.eval_micro_batch_size: int | None = None
        self.last_micro_batch_size: int | None = None  # the size the latest training batch ended with
        self.last_micro_batches = 0  # how many micro-batches it took on this rank
        self._originals: dict[str, Any] = {}  # hook name -> the instance attribute it replaced (or _ABSENT)
        self._train_runner: MicroBatchRunner | None = None
        self._eval_runner: MicroBatchRunner | None = None
        self._warned_batch_norm = False
        self._allocator_retries = 0

    # ---------------------------------------------------------------- setup and teardown
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SingleDeviceStrategy | DDPStrategy) or strategy.handles_gradient_accumulation:
            raise MisconfigurationException(
                f"AdaptiveAccumulation works with single-device and DDP strategies, not {type(strategy).__name__}"
            )
        if stage == "fit":
            self._check_fit(trainer, pl_module)
        agree = self._agree_across_ranks(trainer) if trainer.world_size > 1 else None
        self._train_runner = MicroBatchRunner(pl_module, self.shrink, self.loss_reduction, agree)
        self._allocator_retries = allocator_retries(strategy.root_device)
        self._eval_runner = MicroBatchRunner(pl_module, self.shrink)
        if stage == "fit":
            self._install(pl_module, "training_step", self._training_step(trainer, pl_module))
        if self.evaluation:
            for name in ("validation_step",) if stage == "fit" else _EVAL_STEPS[stage]:
                self._install(pl_module, name, self._evaluation_step(pl_module, name))

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

    @staticmethod
    def _agree_across_ranks(trainer: Trainer) -> Callable[[list[int]], list[int]]:
        def agree(values: list[int]) -> list[int]:
            flags = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
            return trainer.strategy.reduce(flags, reduce_op="max").tolist()

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
    def _training_step(self, trainer: Trainer, pl_module: LightningModule) -> Callable[..., Any]:
        original = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if not trainer.training:
                return original(*args, **kwargs)
            batch, batch_idx = _batch_and_index(args, kwargs)
            return self._train_batch(trainer, pl_module, _on_chunks(original, args, kwargs), batch, batch_idx)

        return training_step

    def _train_batch(
        self, trainer: Trainer, pl_module: LightningModule, step: Callable[[Any], Any], batch: Any, batch_idx: int
    ) -> Any:
        assert self._train_runner is not None
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            # Lightning zeroes after training_step, before backward; the micro-batches' backward comes first
            pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, trainer.optimizers[0])
        total = batch_size(batch)
        size = self.sizer.size_for(trainer.global_step, total)
        if size < total:
            self._warn_batch_norm(pl_module, size, total)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        try:
            result = self._train_runner.run(
                step,
                batch,
                size,
                backward=lambda loss: _backward(loss, scaler),
                weight=1.0 / accumulate,
                flags=[self._allocator_retried_since_last_batch(trainer)],
            )
        except SampleOutOfMemoryError as error:
            raise self._with_profile(error, trainer, pl_module) from None
        if result.micro_batch_size < size:
            self.sizer.recovered(trainer.global_step, result.micro_batch_size)
            self._warn_batch_norm(pl_module, result.micro_batch_size, total)
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

    def _allocator_retried_since_last_batch(self, trainer: Trainer) -> int:
        if self.sizer.thrash_steps is None:
            return 0
        retries = allocator_retries(trainer.strategy.root_device)
        retried, self._allocator_retries = retries > self._allocator_retries, retries
        return int(retried)

    def _warn_batch_norm(self, pl_module: LightningModule, size: int, total: int) -> None:
        if self._warned_batch_norm or size >= total:
            return
        layers = [type(m).__name__ for m in pl_module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if layers:
            self._warned_batch_norm = True
            rank_zero_warn(
                f"AdaptiveAccumulation: micro-batches of {size} (of {total}) change the batch statistics of the "
                f"model's {len(layers)} batch-norm layers ({', '.join(sorted(set(layers)))}). SyncBatchNorm "
                "(statistics over every rank's micro-batch), ghost batch norm, or GroupNorm / LayerNorm keep them "
                "independent of the micro-batch size"
            )

    def _with_profile(
        self, error: SampleOutOfMemoryError, trainer: Trainer, pl_module: LightningModule
    ) -> SampleOutOfMemoryError:
        """The error again, with a fake-mode memory profile of a training step on the failing sample."""
        if error.sample is None:
            return error
        precision = getattr(trainer.precision_plugin, "precision", trainer.precision)
        precision = precision if precision in PRECISIONS else "32-true"
        try:
            with _disable_current_modes(), self._unwrapped(pl_module, "training_step"):
                profile = profile_step(pl_module, error.sample, mode="fake", precision=precision)
        except Exception as failure:  # the profile is a diagnosis: its own failure must not hide the OOM
            return SampleOutOfMemoryError(
                f"{error}\n(no memory profile: {type(failure).__name__}: {failure})", error.sample
            )
        return SampleOutOfMemoryError(
            f"{error}\nA training step on that one sample, predicted in fake mode:\n{profile.table()}\n"
            "Lower the memory per sample: ActivationCheckpointing, PrecisionSwitch('auto'), a smaller input or model",
            error.sample,
            profile,
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
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.schedule is None or batch_idx % trainer.accumulate_grad_batches:
            return
        wanted = self.schedule.at(trainer.global_step)
        if wanted != trainer.accumulate_grad_batches and batch_idx % wanted == 0:  # windows stay aligned
            rank_zero_info(
                f"AdaptiveAccumulation: accumulate_grad_batches {trainer.accumulate_grad_batches} -> {wanted} "
                f"at step {trainer.global_step}"
            )
            trainer.accumulate_grad_batches = wanted

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.last_micro_batch_size is None:
            return
        pl_module.log("memopt/micro_batch_size", float(self.last_micro_batch_size), on_step=True, on_epoch=False)
        pl_module.log("memopt/oom_recoveries", float(self.sizer.oom_recoveries), on_step=True, on_epoch=False)

    # ---------------------------------------------------------------- evaluation
    def _evaluation_step(self, pl_module: LightningModule, name: str) -> Callable[..., Any]:
        original = getattr(pl_module, name)

        def evaluation_step(*args: Any, **kwargs: Any) -> Any:
            assert self._eval_runner is not None
            batch, _ = _batch_and_index(args, kwargs)
            total = batch_size(batch)
            size = total if self.eval_micro_batch_size is None else min(self.eval_micro_batch_size, total)
            result = self._eval_runner.run(_on_chunks(original, args, kwargs), batch, size)
            if result.micro_batch_size < size:
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
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sizer.load_state_dict(state_dict)
        self.eval_micro_batch_size = state_dict.get("eval_micro_batch_size")
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
    reducer all-reduce it once per step, and it runs the backward hooks once per batch. The
    gradients already carry the loss weights and the gradient scaler's scale, so the incoming
    gradient (``scale / accumulate_grad_batches``) is not applied to them again.
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
    loss = _DeliverGradients.apply(result.loss, gradients, *parameters)
    return loss if isinstance(result.output, torch.Tensor) else type(result.output)({**result.output, "loss": loss})


def _backward(loss: torch.Tensor, scaler: Any) -> None:
    # outside the training step's autocast, as Lightning runs its backward
    with torch.autocast(loss.device.type, enabled=False):
        (scaler.scale(loss) if scaler is not None else loss).backward()


def _batch_and_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, batch_idx


def _on_chunks(step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Any], Any]:
    """``step`` called as Lightning called it, with a micro-batch in place of the batch."""

    def on_chunk(chunk: Any) -> Any:
        if args:
            return step(chunk, *args[1:], **kwargs)
        return step(**{**kwargs, "batch": chunk})

    return on_chunk
