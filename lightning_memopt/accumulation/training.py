"""TrainingRecovery: training batches in micro-batches that recover from out-of-memory, without a Trainer.

The functional core of :class:`~lightning_memopt.AdaptiveAccumulation`: the callback decides when
(it wraps ``training_step``, zeroes the gradients, hands them to Lightning's backward); this does the
work for one batch: the micro-batch size the run has reached, the smallest the model takes, the
recovery, and the shrink before a thrashing allocator fails. :func:`deliver` then hands the accumulated
gradients to the loop's own backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memopt.accumulation.errors import log_info, log_warning
from lightning_memopt.accumulation.lockstep import TRAINING_STEP, Lockstep
from lightning_memopt.accumulation.runner import Agree, MicroBatchResult, MicroBatchRunner, check_loss_reduction
from lightning_memopt.accumulation.sizing import MicroBatchSizer, batch_norms, update_min_size
from lightning_memopt.batch_slicing import batch_size_or_none, with_loss
from lightning_memopt.memory.allocator import allocator_retries
from lightning_memopt.private_api import is_batch_norm


class TrainingRecovery:
    """Run each training batch in micro-batches of the size the run has reached, recovering from out-of-memory.

    It owns the :class:`MicroBatchSizer` and the smallest micro-batch an error taught (both in
    :meth:`state_dict`, so a resumed run starts where this one was), and, once :meth:`attach`\\ ed to a
    module, the :class:`MicroBatchRunner` that runs the batches. A batch that ran out of memory and
    completed smaller sets the size for later ones; CUDA allocator retries in ``thrash_steps``
    batches in a row shrink it before it fails. Warnings say once that micro-batches change
    batch-norm statistics, or a loss the module declares batch-coupled (``batch_coupled_loss``).

    Args:
        sizer: the micro-batch size over the run (its ``shrink`` also cuts a piece that failed).
        loss_reduction: ``"mean"`` if the step's loss averages its samples, ``"sum"`` if it sums them.

    Raises:
        ValueError: for an unknown ``loss_reduction``.

    Example::

        >>> model = nn.Linear(4, 1)
        >>> recovery = TrainingRecovery(MicroBatchSizer())
        >>> recovery.attach(model)
        >>> def step(x):
        ...     if len(x) > 4:
        ...         raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        ...     return model(x).pow(2).mean()
        >>> result = recovery.run(step, torch.randn(16, 4), global_step=0, backward=torch.Tensor.backward)
        >>> result.sizes, recovery.sizer.size, recovery.sizer.oom_recoveries
        ([4, 4, 4, 4], 4, 1)
    """

    def __init__(self, sizer: MicroBatchSizer, loss_reduction: str = "mean") -> None:
        check_loss_reduction(loss_reduction)
        self.sizer = sizer
        self.loss_reduction = loss_reduction
        self.runner: MicroBatchRunner | None = None
        self.lockstep: Lockstep | None = None
        self.learned_min_size: int | None = None  # taught by an error on a small micro-batch (saved in checkpoints)
        self.learned_min_size_reason: str | None = None
        self.last_micro_batch_size: int | None = None  # the size the latest batch ended with
        self.last_micro_batches = 0  # how many micro-batches it took on this rank
        self._device: torch.device | str = "cpu"
        self._allocator_retries = 0
        self._norms: list[nn.Module] | None = None  # the module's batch norms, listed at its first batch
        self._warned: set[str] = set()

    def attach(
        self,
        module: nn.Module,
        *,
        device: torch.device | str = "cpu",
        agree: Agree | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        """Run ``module``'s batches from now on (a new run: the size and what was learned are kept).

        Args:
            module: whose parameters take the gradients.
            device: where it runs (whose CUDA allocator's retries are watched).
            agree: the element-wise maximum over ranks (:func:`~lightning_memopt.distributed.max_over_ranks`);
                ``None`` for one process.
            lockstep: under FSDP, this rank's place: every micro-batch is collectives, nothing is retried.
        """
        self._norms, self._device, self.lockstep = None, device, lockstep
        shrink = self.sizer.shrink
        self.runner = MicroBatchRunner(module, shrink, self.loss_reduction, agree, lockstep=lockstep is not None)
        self.update_min_size(cached=False)
        self._allocator_retries = allocator_retries(device)

    def update_min_size(self, cached: bool = True) -> None:
        """The smallest micro-batch the module takes as it is now (or as an error taught), for the runner and sizer.

        ``cached``: read the modes of the batch norms listed at the first batch (after ``configure_model``
        has built every layer) instead of walking the module again, as every step does.
        """
        runner = self._runner()
        if cached and self._norms is None:
            self._norms = batch_norms(runner.module)
        learned = (self.learned_min_size, self.learned_min_size_reason)
        size, reason = update_min_size(runner, self._norms if cached else None, learned)
        self.sizer.min_size = size
        if self.sizer.size is not None and self.sizer.size < size:
            self._warn_once(
                "min_size",
                f"AdaptiveAccumulation: micro-batches of {self.sizer.size} are raised to {size}, the smallest the "
                f"model takes: {reason}",
            )
            self.sizer.size = size

    def run(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        global_step: int,
        *,
        backward: Callable[[torch.Tensor], None],
        weight: float = 1.0,
    ) -> MicroBatchResult:
        """Run one training batch: forward and ``backward`` on each micro-batch, gradients left in ``.grad``.

        Args:
            step: ``step(micro_batch) -> loss`` (or a mapping with ``"loss"``).
            batch: the whole batch (a batch that cannot be split runs whole).
            global_step: the optimizer step it belongs to (when the size grows back, what a message says).
            backward: ``backward(weighted_loss)`` (see :func:`~lightning_memopt.accumulation.training.scaled_backward`).
            weight: a factor on every loss (``1 / accumulate_grad_batches``).

        Raises:
            SampleOutOfMemoryError, MicroBatchSizeError: as :meth:`MicroBatchRunner.run`.
            RanksOutOfStepError: in lockstep, after an out-of-memory error on this or another rank.
        """
        runner = self._runner()
        self.update_min_size(cached=True)  # batch norms may have been frozen since
        total = batch_size_or_none(batch)  # None: a batch that cannot be split runs whole
        size = None if total is None else self.sizer.size_for(global_step, total)
        if total is not None and size is not None:
            self._warn_batch_coupling(size, total)
        retried = self._allocator_retried()
        guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.lockstep is not None:
            guard = self.lockstep.stop_every_rank_on_error(TRAINING_STEP, size, total, global_step, self.resume_size)
        try:
            with guard:
                result = runner.run(step, batch, size, backward=backward, weight=weight, flags=[retried])
        finally:
            self._learned_from_runner()
        if total is None:  # ran whole (another rank's recovery cannot change that)
            return result
        if result.recovered:
            self.sizer.recovered(global_step, result.micro_batch_size)
            self._allocator_retries = allocator_retries(self._device)  # the OOM's own retries
            self._warn_batch_coupling(result.micro_batch_size, total)
            cause = f" ({result.oom_errors[0][:160]})" if result.oom_errors else " on another rank"
            log_info(
                f"AdaptiveAccumulation: out of memory at step {global_step} with micro-batches of {size}{cause}; "
                f"the batch of {total} ran in micro-batches of {result.micro_batch_size} ({len(result.sizes)} on "
                "this rank) and the optimizer step is unchanged"
            )
        elif self.sizer.allocator_retried(bool(result.flags[0]), global_step, total):
            log_info(
                f"AdaptiveAccumulation: the CUDA allocator retried in {self.sizer.thrash_steps} batches in a row; "
                f"micro-batches of {self.sizer.size} from step {global_step}, before it runs out of memory"
            )
        self.last_micro_batch_size = min(result.micro_batch_size, total)
        self.last_micro_batches = len(result.sizes)
        return result

    def resume_size(self, size: int | None) -> int | None:
        """The micro-batch size to resume with after ``size`` ran out of memory (``None``: none smaller is taken)."""
        least = self.sizer.min_size
        if size is None or size <= least:
            return None
        return max(self.sizer.shrink(size), least)

    def state_dict(self) -> dict[str, Any]:
        """The sizer's state and the learned minimum (``learned_min_size``, ``learned_min_size_reason``)."""
        return {
            **self.sizer.state_dict(),
            "learned_min_size": self.learned_min_size,
            "learned_min_size_reason": self.learned_min_size_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (older checkpoints lack the learned minimum); an attached runner takes it now."""
        self.sizer.load_state_dict(state)
        self.learned_min_size = state.get("learned_min_size")
        self.learned_min_size_reason = state.get("learned_min_size_reason")
        if self.runner is not None:  # restored after attach: the runner and sizer take it now
            self.update_min_size(cached=False)

    def _runner(self) -> MicroBatchRunner:
        if self.runner is None:
            raise RuntimeError("TrainingRecovery runs batches once attached to a module: call `attach(module)` first")
        return self.runner

    def _learned_from_runner(self) -> None:
        """Keep the minimum the runner learned from an error (for later batches and the checkpoint)."""
        learned = self._runner().learned_min_size
        if learned is not None and learned > (self.learned_min_size or 0):
            self.learned_min_size, self.learned_min_size_reason = learned, self._runner().learned_min_size_reason
            self.sizer.min_size = max(self.sizer.min_size, learned)

    def _allocator_retried(self) -> int:
        """Whether the CUDA allocator retried since the last batch (0 when thrashing is not watched)."""
        if self.sizer.thrash_steps is None:
            return 0
        retries = allocator_retries(self._device)
        retried, self._allocator_retries = retries > self._allocator_retries, retries
        return int(retried)

    def _warn_batch_coupling(self, size: int, total: int) -> None:
        """Warn once each: micro-batches change batch-norm statistics, and a loss over the batch's samples."""
        if size >= total:
            return
        module = self._runner().module
        layers = [type(m).__name__ for m in module.modules() if is_batch_norm(m)]
        if layers:
            self._warn_once(
                "batch_norm",
                f"AdaptiveAccumulation: micro-batches of {size} (of {total}) change the batch statistics of the "
                f"model's {len(layers)} batch-norm layers ({', '.join(sorted(set(layers)))}). Ghost batch norm or "
                "GroupNorm / LayerNorm keep them independent of the micro-batch size; SyncBatchNorm pools every "
                "rank's micro-batch (under DDP, with a `micro_batch_size` that fits: see docs/guide/accumulation.md)",
            )
        coupled = getattr(module, "batch_coupled_loss", None)
        if coupled:
            self._warn_once(
                "coupled_loss",
                f"AdaptiveAccumulation: micro-batches of {size} (of {total}) change {coupled}: it couples the "
                "samples of a batch, so each micro-batch is a batch of its own to it. Give a batch that fits, "
                "or accept a loss computed on the smaller batches",
            )

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log_warning(message)


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


def deliver(module: nn.Module, result: MicroBatchResult) -> Any:
    """The step's output, its loss carrying ``module``'s accumulated gradients to the loop's backward.

    The gradients leave ``.grad`` (the loop's ``zero_grad`` before its backward finds nothing to
    clear) and come back when the returned loss is back-propagated, with any incoming gradient ignored.

    Example::

        >>> from lightning_memopt.accumulation import MicroBatchRunner
        >>> model = torch.nn.Linear(3, 1)
        >>> result = MicroBatchRunner(model).run(lambda x: model(x).mean(), torch.ones(4, 3), 2,
        ...                                      backward=torch.Tensor.backward)
        >>> output = deliver(model, result)
        >>> model.bias.grad is None
        True
        >>> output.backward(torch.tensor(0.5))  # the loop's backward, its scale already applied
        >>> model.bias.grad  # the whole batch's mean, the incoming 0.5 not applied again
        tensor([1.])
    """
    if result.loss is None:
        return result.output
    parameters = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
    gradients = [p.grad for p in parameters]
    for parameter in parameters:
        parameter.grad = None  # Lightning's zero_grad, which runs before its backward, finds nothing to clear
    return with_loss(result.output, _DeliverGradients.apply(result.loss, gradients, *parameters))


def scaled_backward(backward: Callable[[torch.Tensor], None], scaler: Any = None) -> Callable[[torch.Tensor], None]:
    """``backward`` of each micro-batch's loss, scaled by the gradient ``scaler`` (if any), outside autocast.

    As Lightning runs its backward: outside the training step's autocast, through the module's
    ``backward`` hook (pass ``pl_module.backward``; ``torch.Tensor.backward`` for a plain module).

    Example::

        >>> weight = torch.ones(2, requires_grad=True)
        >>> scaled_backward(torch.Tensor.backward)((weight * 3).sum())
        >>> weight.grad
        tensor([3., 3.])
    """

    def run(loss: torch.Tensor) -> None:
        with torch.autocast(loss.device.type, enabled=False):
            backward(scaler.scale(loss) if scaler is not None else loss)

    return run
