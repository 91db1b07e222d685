"""Run one batch in micro-batches, and recover from out-of-memory by splitting it further.

The gradients of the samples that completed are kept: an out-of-memory error in a micro-batch's
forward pass left nothing behind, and one in its backward pass left the gradients of the
parameters it had already reached. Each parameter remembers up to which sample its gradient is
complete, so when the failed micro-batch is redone in smaller pieces, those parameters take no
second contribution. No sample is dropped or counted twice, and no gradient copy is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_memopt.accumulation.split import BatchSplitError, batch_size, merge_outputs, slice_batch
from lightning_memopt.memory.oom import is_oom_error, release_memory

LOSS_REDUCTIONS = ("mean", "sum")
Shrink = Callable[[int], int]
Agree = Callable[[list[int]], list[int]]


def check_loss_reduction(loss_reduction: str) -> None:
    """Raise ``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"Unknown `loss_reduction`={loss_reduction!r}; valid choices: {', '.join(LOSS_REDUCTIONS)}")


def halve(size: int) -> int:
    """The next micro-batch size after an out-of-memory error: half, rounded up.

    Example::

        >>> [halve(n) for n in (64, 3, 2)]
        [32, 2, 1]
    """
    return (size + 1) // 2


class SampleOutOfMemoryError(torch.OutOfMemoryError):
    """Even a micro-batch of one sample runs out of memory, or a batch that cannot be split does.

    Attributes:
        sample: what failed: the one-sample micro-batch, or the whole batch that cannot be split
            (``None`` on the ranks where another rank failed).
        profile: a :class:`~lightning_memopt.memory.MemoryProfile` of a step on that sample, when known.
    """

    def __init__(self, message: str, sample: Any = None, profile: Any = None) -> None:
        super().__init__(message)
        self.sample = sample
        self.profile = profile


@dataclass
class MicroBatchResult:
    """What one batch's micro-batches produced."""

    output: Any  # the merged output; a training step's loss is the whole batch's, detached
    loss: torch.Tensor | None  # the whole batch's loss, detached (None without a backward pass)
    sizes: list[int]  # the micro-batches that completed, in order
    micro_batch_size: int  # the size to use next (agreed by every rank)
    recovered: bool = False  # some rank ran out of memory in this batch and recovered (agreed)
    oom_errors: list[str] = field(default_factory=list)  # the out-of-memory errors recovered from here
    flags: list[int] = field(default_factory=list)  # the ``flags`` passed to ``run``, maximum over ranks


@dataclass
class _Run:
    batch: Any
    total: int
    step: Callable[[Any], Any]
    backward: Callable[[torch.Tensor], None] | None
    weight: float
    outputs: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    oom_errors: list[str] = field(default_factory=list)
    covered: list[int] = field(default_factory=list)  # per parameter: its gradient holds samples [0, covered)
    chunk_end: int = 0
    failed_sample: Any = None
    unsplittable: BatchSplitError | None = None  # why the batch can only run whole


class MicroBatchRunner:
    """Run a step over a batch in micro-batches, shrinking them when memory runs out.

    With ``backward``, each micro-batch's loss is weighted by its share of the batch (``"mean"``
    losses) and back-propagated at once, so the gradients equal the whole batch's; without it the
    step only runs forward (evaluation). On an out-of-memory error the failed micro-batch is redone
    in pieces of ``shrink(size)`` and later ones use that size. ``agree`` makes several processes
    decide together: it takes a list of ints and returns their element-wise maximum over ranks.
    It is called once per micro-batch of the agreed size, with whether this rank failed and the
    smallest size that worked, so every rank continues with the same micro-batches. The rank that
    failed redoes its failed piece in smaller pieces by itself, between two agreements.

    Args:
        module: whose parameters take gradients and whose buffers (batch-norm statistics) are
            restored when a micro-batch fails part-way.
        shrink: ``size -> smaller size`` after an out-of-memory error (default :func:`halve`).
        loss_reduction: ``"mean"`` (the step's loss averages its samples: weighted by share) or
            ``"sum"`` (summed: added as is).
        agree: element-wise maximum over ranks; ``None`` for one process.

    Raises:
        ValueError: for an unknown ``loss_reduction``.

    Example::

        >>> model = nn.Linear(4, 1)
        >>> batch = torch.randn(10, 4)
        >>> result = MicroBatchRunner(model).run(lambda x: model(x).pow(2).mean(), batch, 4,
        ...                                      backward=torch.Tensor.backward)
        >>> result.sizes, round(result.loss.item(), 6) == round(model(batch).pow(2).mean().item(), 6)
        ([4, 4, 2], True)
    """

    def __init__(
        self,
        module: nn.Module,
        shrink: Shrink = halve,
        loss_reduction: str = "mean",
        agree: Agree | None = None,
    ) -> None:
        check_loss_reduction(loss_reduction)
        self.module = module
        self.shrink = shrink
        self.loss_reduction = loss_reduction
        self.agree = agree

    def run(
        self,
        step: Callable[[Any], Any],
        batch: Any,
        micro_batch_size: int | None = None,
        *,
        backward: Callable[[torch.Tensor], None] | None = None,
        weight: float = 1.0,
        flags: Sequence[int] = (),
    ) -> MicroBatchResult:
        """Run ``step`` on micro-batches of ``batch`` of at most ``micro_batch_size`` samples (``None``: whole).

        Args:
            step: ``step(micro_batch) -> loss``, a dict with ``"loss"``, any output, or ``None``.
            batch: tensors, tuples, lists, dicts or dataclasses of them (see :func:`slice_batch`).
            micro_batch_size: the largest micro-batch to try first.
            backward: ``backward(weighted_loss)`` after each micro-batch (e.g. scale, then backward);
                ``None`` runs forward only.
            weight: a factor on every loss before ``backward`` (``1 / accumulate_grad_batches``).
            flags: ints of this rank to agree on as well; their maximum over ranks is in ``result.flags``.

        A batch that :func:`batch_size` cannot measure runs whole when ``micro_batch_size`` is
        ``None``; only if it then runs out of memory is that an error.

        Raises:
            SampleOutOfMemoryError: when a single sample, or a batch that cannot be split, runs out
                of memory (on every rank).
            BatchSplitError: for a ``micro_batch_size`` with a batch that cannot be split.
            ValueError: for a batch without samples.
        """
        try:
            total, unsplittable = batch_size(batch), None
        except BatchSplitError as error:
            if micro_batch_size is not None:
                raise
            total, unsplittable = 1, error  # it runs whole, as one indivisible piece
        if total == 0:
            raise ValueError("`batch` has no samples: there is nothing to run")
        size = total if micro_batch_size is None else max(1, min(int(micro_batch_size), total))
        run = _Run(batch, total, step, backward, weight, unsplittable=unsplittable)
        parameters = [p for p in self.module.parameters() if p.requires_grad] if backward is not None else []
        run.covered = [0] * len(parameters)
        handles = [p.register_post_accumulate_grad_hook(self._coverage(run, i)) for i, p in enumerate(parameters)]
        agreed_flags, recovered = list(flags), False
        try:
            position = 0
            while True:
                failure = None
                if position < total:
                    end = min(position + size, total)
                    size, failure = self._run_range(run, parameters, position, end, size)
                    position = end
                negative_size, failed, unfinished, oom, *agreed_flags = self._agree(
                    [-size, int(failure is not None), int(position < total), int(bool(run.oom_errors)), *agreed_flags]
                )
                recovered = recovered or bool(oom)
                if failed:
                    raise self._one_sample_error(run, failure)
                size = -negative_size
                if not unfinished:
                    break
        finally:
            for handle in handles:
                handle.remove()
        return self._result(run, size, recovered, agreed_flags)

    def _agree(self, values: list[int]) -> list[int]:
        return values if self.agree is None else [int(v) for v in self.agree(values)]

    @staticmethod
    def _coverage(run: _Run, index: int) -> Callable[[torch.Tensor], None]:
        def covered(parameter: torch.Tensor) -> None:
            run.covered[index] = max(run.covered[index], run.chunk_end)  # a skipped (zero) gradient also lands here

        return covered

    def _run_range(
        self, run: _Run, parameters: list[nn.Parameter], start: int, stop: int, size: int
    ) -> tuple[int, str | None]:
        """Samples ``start:stop`` in pieces of ``size``, smaller after a failure; the size it ends with."""
        position = start
        while position < stop:
            end = min(position + size, stop)
            error = self._run_chunk(run, parameters, position, end)
            if error is None:
                position = end
                continue
            run.oom_errors.append(error)
            release_memory()
            if end - position == 1:
                run.failed_sample = _piece(run, position, end)
                return size, error
            # redo the failed piece smaller; `end` stays a boundary, so gradient coverage lines up
            size, failure = self._run_range(run, parameters, position, end, self._smaller(end - position))
            if failure is not None:
                return size, failure
            position = end
        return size, None

    def _smaller(self, size: int) -> int:
        smaller = self.shrink(size)
        if isinstance(smaller, bool) or not isinstance(smaller, int) or not 1 <= smaller < size:
            raise ValueError(f"`shrink`({size}) returned {smaller!r}; it must return an int in [1, {size - 1}]")
        return smaller

    def _run_chunk(self, run: _Run, parameters: list[nn.Parameter], start: int, stop: int) -> str | None:
        # parameters whose gradient already holds these samples (from a backward that failed later on)
        done = [p.register_hook(_no_gradient) for i, p in enumerate(parameters) if run.covered[i] >= stop]
        run.chunk_end = stop
        snapshot: dict[str, torch.Tensor] = {}
        try:
            if run.backward is not None:  # batch-norm statistics, put back if the piece fails part-way
                snapshot = {name: buffer.clone() for name, buffer in self.module.named_buffers()}
            self._forward_backward(run, _piece(run, start, stop), stop - start)
        except Exception as error:
            if not is_oom_error(error):
                raise
            message = f"{type(error).__name__}: {error}"
        else:
            return None
        finally:
            for handle in done:
                handle.remove()
        for name, saved in snapshot.items():  # by name: a forward may have assigned a new tensor
            self.module.get_buffer(name).copy_(saved)
        return message

    def _forward_backward(self, run: _Run, chunk: Any, samples: int) -> None:
        output = run.step(chunk)
        loss = _loss_of(output)
        share = samples / run.total if self.loss_reduction == "mean" else 1.0
        if run.backward is not None:
            if loss is not None:
                run.backward(loss * (share * run.weight))
            output = apply_to_collection(output, torch.Tensor, torch.Tensor.detach)  # no graph outlives its piece
        run.outputs.append(output)
        run.sizes.append(samples)
        if loss is not None:
            run.losses.append(loss.detach() * share)

    def _one_sample_error(self, run: _Run, failure: str | None) -> SampleOutOfMemoryError:
        if failure is None:
            return SampleOutOfMemoryError(
                "AdaptiveAccumulation: another rank ran out of memory on a piece it cannot split further; "
                "every rank stops together"
            )
        if run.unsplittable is not None:
            return SampleOutOfMemoryError(
                f"AdaptiveAccumulation: the batch ran out of memory ({failure}) and cannot be split into "
                f"micro-batches: {run.unsplittable}",
                sample=run.batch,
            )
        return SampleOutOfMemoryError(
            f"AdaptiveAccumulation: a micro-batch of one sample does not fit ({failure})",
            sample=run.failed_sample,
        )

    def _result(self, run: _Run, size: int, recovered: bool, flags: list[int]) -> MicroBatchResult:
        loss = torch.stack(run.losses).sum() if run.losses and run.backward is not None else None
        output = merge_outputs(run.outputs, run.sizes)
        if loss is not None and len(run.outputs) > 1:
            output = with_loss(output, loss)
        return MicroBatchResult(output, loss, run.sizes, size, recovered, run.oom_errors, flags)


def _no_gradient(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return None


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """``output`` (a loss tensor or a mapping with ``"loss"``) with ``loss`` as its loss."""
    if isinstance(output, torch.Tensor):
        return loss
    return type(output)({**output, "loss": loss})


def _piece(run: _Run, start: int, stop: int) -> Any:
    if run.unsplittable is not None or (start, stop) == (0, run.total):
        return run.batch
    return slice_batch(run.batch, start, stop)
