"""Run one batch in micro-batches, and recover from out-of-memory by splitting it further.

The gradients of the samples that completed are kept: an out-of-memory error in a micro-batch's
forward pass left nothing behind, and one in its backward pass left the gradients of the
parameters it had already reached. Each parameter remembers up to which sample its gradient is
complete, so when the failed micro-batch is redone in smaller pieces, those parameters take no
second contribution. No sample is dropped or counted twice, and no gradient copy is made.

No piece is cut below the smallest micro-batch the model takes (``min_size``: 2 for a model with
batch-norm layers in training, which need two samples to compute a variance). A model whose limit
inspection cannot see teaches it: a piece smaller than those already tried that raises an error
other than out-of-memory raises the minimum above its size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_memopt.accumulation.split import BatchSplitError, batch_size, merge_outputs, slice_batch
from lightning_memopt.memory.oom import is_oom_error, release_memory

LOSS_REDUCTIONS = ("mean", "sum")
LossReduction = Literal["mean", "sum"]  # == LOSS_REDUCTIONS
Shrink = Callable[[int], int]
Agree = Callable[[list[int]], list[int]]
_OOM, _SIZE = 1, 2  # what stopped a batch, as ranks agree on it (the larger wins)


def check_loss_reduction(loss_reduction: str) -> None:
    """Raise ``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"Unknown `loss_reduction`={loss_reduction!r}; valid choices: {', '.join(LOSS_REDUCTIONS)}")


def check_min_size(min_size: int) -> None:
    """Raise ``ValueError`` unless ``min_size`` is an int ≥ 1."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"`min_size`={min_size!r} must be an int ≥ 1 (1: any size; 2: batch norm in training)")


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch-norm layers of ``module`` (what :func:`min_micro_batch_size` looks at)."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def min_micro_batch_size(
    module: nn.Module, norms: list[nn.modules.batchnorm._BatchNorm] | None = None
) -> tuple[int, str | None]:
    """The smallest micro-batch ``module`` takes as it is now, and why (``None`` when any size does).

    A batch-norm layer that normalises by the batch's statistics (in training, or without running
    statistics) needs at least 2 samples for an ``[N, C]`` input: one sample has no variance.
    ``norms``: the module's :func:`batch_norms`, when already known (their modes are read now).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> min_micro_batch_size(model)
        (2, 'its BatchNorm1d layers need at least 2 samples in training')
        >>> min_micro_batch_size(model.eval())
        (1, None)
    """
    layers = sorted(
        {
            type(m).__name__
            for m in (batch_norms(module) if norms is None else norms)
            if m.training or (m.running_mean is None and m.running_var is None)
        }
    )
    if not layers:
        return 1, None
    return 2, f"its {', '.join(layers)} layers need at least 2 samples in training"


def halve(size: int) -> int:
    """The next micro-batch size after an out-of-memory error: half, rounded up.

    Example::

        >>> [halve(n) for n in (64, 3, 2)]
        [32, 2, 1]
    """
    return (size + 1) // 2


class SampleOutOfMemoryError(torch.OutOfMemoryError):
    """Even the smallest micro-batch the model takes runs out of memory, or a batch that cannot be split does.

    The smallest is one sample, or more for a model that takes no fewer (``MicroBatchRunner.min_size``:
    two with batch norm in training); a piece that cannot be cut into pieces of at least that many
    samples fails the same way.

    Attributes:
        sample: what failed: the smallest micro-batch, or the whole batch that cannot be split
            (``None`` on the ranks where another rank failed).
        profile: a :class:`~lightning_memopt.memory.MemoryProfile` of a step on that sample, when known.
        size: how many samples ``sample`` holds (``None`` when unknown).
    """

    def __init__(self, message: str, sample: Any = None, profile: Any = None, size: int | None = None) -> None:
        super().__init__(message)
        self.sample = sample
        self.profile = profile
        self.size = size


class MicroBatchSizeError(ValueError):
    """A micro-batch smaller than those already tried raised an error: the model does not take so few samples.

    The batch cannot be completed (its earlier micro-batches are already accumulated), but the
    runner has learned the minimum: later batches are cut into micro-batches of at least ``min_size``.
    The original error is the ``__cause__``.

    Attributes:
        size: the micro-batch size the model rejected (``None`` on the ranks where another rank failed).
        min_size: the smallest micro-batch size from now on.
    """

    def __init__(self, message: str, size: int | None = None, min_size: int = 1) -> None:
        super().__init__(message)
        self.size = size
        self.min_size = min_size


class RanksOutOfStepError(RuntimeError):
    """A step failed in the middle of its collectives (FSDP): the ranks cannot realign, every rank stops.

    The rank whose step ran out of memory says so; the other ranks say that a collective failed
    because another rank stopped. Both name the micro-batch size to resume with.

    Attributes:
        rank: the rank raising it.
        micro_batch_size: the micro-batch size the step ran with (the whole batch's size without micro-batches).
        resume_size: the micro-batch size to resume from the last checkpoint with (``None``: none is smaller).
    """

    def __init__(self, message: str, rank: int, micro_batch_size: int | None, resume_size: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.resume_size = resume_size


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
    unsplittable: BatchSplitError | None = None  # why the batch can only run whole
    largest_tried: int = 0  # the largest piece attempted on this rank, fitting or not
    smallest_done: int | None = None  # the smallest piece that completed on this rank
    failure: _Failure | None = None  # what stopped this batch on this rank


@dataclass
class _Failure:
    kind: int  # _OOM: a piece that cannot be split ran out of memory; _SIZE: a piece too small for the model
    start: int  # the samples that failed
    stop: int
    message: str  # the error: "type: message"
    cause: BaseException | None = None  # a non-OOM error that taught the minimum


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

    No piece is cut below ``min_size`` (see :func:`min_micro_batch_size`): a remainder that would
    be smaller takes samples from the piece before it, and a piece that runs out of memory and
    cannot be cut into pieces of at least ``min_size`` is a :class:`SampleOutOfMemoryError`. A
    piece smaller than one already tried in the batch that raises another error tells the size
    the model rejects: ``min_size`` (and ``learned_min_size``) becomes one more, and the batch
    ends in a :class:`MicroBatchSizeError` (or, redoing a piece that ran out of memory, in a
    :class:`SampleOutOfMemoryError`).

    With ``lockstep`` the micro-batches' forward and backward passes are collectives themselves
    (FSDP gathers each unit's parameters and reduce-scatters its gradients): every rank runs as
    many micro-batches, checked before the first, and an error in one is raised as it is, with no
    retry, since the other ranks are waiting in its collectives.

    Args:
        module: whose parameters take gradients and whose buffers (batch-norm statistics) are
            restored when a micro-batch fails part-way.
        shrink: ``size -> smaller size`` after an out-of-memory error (default :func:`halve`).
        loss_reduction: ``"mean"`` (the step's loss averages its samples: weighted by share) or
            ``"sum"`` (summed: added as is).
        agree: element-wise maximum over ranks; ``None`` for one process.
        min_size: the smallest micro-batch the model takes (2 with batch norm in training).
        min_size_reason: why, for the error messages (e.g. ``"its BatchNorm1d layers need ..."``).
        lockstep: every rank runs the same micro-batches in step with the others, and nothing is retried.

    Raises:
        ValueError: for an unknown ``loss_reduction`` or a ``min_size`` below 1.

    Example::

        >>> model = nn.Linear(4, 1)
        >>> batch = torch.randn(10, 4)
        >>> result = MicroBatchRunner(model).run(lambda x: model(x).pow(2).mean(), batch, 4,
        ...                                      backward=torch.Tensor.backward)
        >>> result.sizes, round(result.loss.item(), 6) == round(model(batch).pow(2).mean().item(), 6)
        ([4, 4, 2], True)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> runner = MicroBatchRunner(model, min_size=2)
        >>> runner.run(lambda x: model(x).mean(), torch.randn(9, 4), 4, backward=torch.Tensor.backward).sizes
        [4, 3, 2]
    """

    def __init__(
        self,
        module: nn.Module,
        shrink: Shrink = halve,
        loss_reduction: str = "mean",
        agree: Agree | None = None,
        min_size: int = 1,
        min_size_reason: str | None = None,
        lockstep: bool = False,
    ) -> None:
        check_loss_reduction(loss_reduction)
        self.module = module
        self.shrink = shrink
        self.loss_reduction = loss_reduction
        self.agree = agree
        self.min_size = min_size
        self.min_size_reason = min_size_reason
        self.lockstep = lockstep
        self.learned_min_size: int | None = None  # set when an error on a smaller piece taught the minimum
        self.learned_min_size_reason: str | None = None

    @property
    def min_size(self) -> int:
        """The smallest micro-batch it cuts (a batch with fewer samples runs whole)."""
        return self._min_size

    @min_size.setter
    def min_size(self, value: int) -> None:
        check_min_size(value)
        self._min_size = value

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
            micro_batch_size: the largest micro-batch to try first (raised to ``min_size``). The last
                pieces may differ so that none is below ``min_size``: 17 in pieces of 8 with a
                minimum of 2 run as 8, 7, 2.
            backward: ``backward(weighted_loss)`` after each micro-batch (e.g. scale, then backward);
                ``None`` runs forward only.
            weight: a factor on every loss before ``backward`` (``1 / accumulate_grad_batches``).
            flags: ints of this rank to agree on as well; their maximum over ranks is in ``result.flags``.

        A batch that :func:`batch_size` cannot measure runs whole when ``micro_batch_size`` is
        ``None``; only if it then runs out of memory is that an error.

        Raises:
            SampleOutOfMemoryError: when the smallest micro-batch the model takes (one sample, or
                ``min_size``), a piece that cannot be cut into pieces of at least ``min_size``, or a
                batch that cannot be split, runs out of memory (on every rank).
            MicroBatchSizeError: when a piece smaller than one already tried raises another error
                (the model rejects that size; on every rank). ``min_size`` is raised above it.
            BatchSplitError: for a ``micro_batch_size`` with a batch that cannot be split.
            ValueError: for a batch without samples; in ``lockstep``, on every rank, when the ranks' batches
                cut into different numbers of micro-batches.
        """
        try:
            total, unsplittable = batch_size(batch), None
        except BatchSplitError as error:
            if micro_batch_size is not None:
                raise
            total, unsplittable = 1, error  # it runs whole, as one indivisible piece
        if total == 0:
            raise ValueError("`batch` has no samples: there is nothing to run")
        size = total if micro_batch_size is None else min(max(int(micro_batch_size), self.min_size, 1), total)
        run = _Run(batch, total, step, backward, weight, unsplittable=unsplittable)
        if self.lockstep:
            self._check_same_pieces(total, size)
        parameters = [p for p in self.module.parameters() if p.requires_grad] if backward is not None else []
        run.covered = [0] * len(parameters)
        handles = [p.register_post_accumulate_grad_hook(self._coverage(run, i)) for i, p in enumerate(parameters)]
        agreed_flags, recovered = list(flags), False
        try:
            position = 0
            while True:
                if position < total and run.failure is None:
                    end = position + self._next_piece(total - position, size)
                    size = self._run_range(run, parameters, position, end, size)
                    position = end
                failure = run.failure
                negative_size, failed, unfinished, oom, min_size, *agreed_flags = self._agree(
                    [
                        -size,
                        0 if failure is None else failure.kind,
                        int(position < total),
                        int(bool(run.oom_errors)),
                        self.min_size,
                        *agreed_flags,
                    ]
                )
                recovered = recovered or bool(oom)
                if min_size > self.min_size:  # another rank learned it
                    self.min_size = self.learned_min_size = min_size
                    self.min_size_reason = self.learned_min_size_reason = "a smaller one failed on another rank"
                if failed:
                    error, cause = self._failure_error(run, failed)
                    raise error from cause
                size = -negative_size
                if not unfinished:
                    break
        finally:
            for handle in handles:
                handle.remove()
        return self._result(run, size, recovered, agreed_flags)

    def _agree(self, values: list[int]) -> list[int]:
        return values if self.agree is None else [int(v) for v in self.agree(values)]

    def _check_same_pieces(self, total: int, size: int) -> None:
        """Raise on every rank unless every rank cuts its batch into as many micro-batches."""
        pieces, position = 0, 0
        while position < total:
            position += self._next_piece(total - position, size)
            pieces += 1
        most, negative_fewest = self._agree([pieces, -pieces])
        if most != -negative_fewest:
            raise ValueError(
                f"in lockstep every rank runs as many micro-batches, but the ranks' batches make {-negative_fewest} "
                f"to {most} (here a batch of {_samples(total)} in micro-batches of {size} makes {pieces}); give every "
                "rank batches of the same size"
            )

    def _next_piece(self, remaining: int, size: int) -> int:
        """How many of ``remaining`` samples the next piece takes: ``size``, unless that leaves too few for a piece."""
        least = self.min_size
        size = max(size, least)
        if remaining <= size or remaining - size >= least:
            return min(size, remaining)
        if remaining >= 2 * least:
            return remaining - least  # ≤ size, and the rest is one piece of `least`
        return remaining  # too few for two pieces: one, above `size`

    @staticmethod
    def _coverage(run: _Run, index: int) -> Callable[[torch.Tensor], None]:
        def covered(parameter: torch.Tensor) -> None:
            run.covered[index] = max(run.covered[index], run.chunk_end)  # a skipped (zero) gradient also lands here

        return covered

    def _run_range(
        self,
        run: _Run,
        parameters: list[nn.Parameter],
        start: int,
        stop: int,
        size: int,
        redoing: str | None = None,
    ) -> int:
        """Samples ``start:stop`` in pieces of ``size``, smaller after a failure; the size it ends with.

        ``redoing`` is the out-of-memory error of ``start:stop`` when it is being redone in smaller
        pieces. What stops the batch is left in ``run.failure``.
        """
        position = start
        while position < stop:
            end = position + self._next_piece(stop - position, size)
            caught = self._run_chunk(run, parameters, position, end)
            if caught is None:
                position = end
                continue
            message, rejected = caught
            if rejected is not None:  # a size the model rejects (any other error was raised as it is)
                self._learn(end - position, message)
                if redoing is not None:  # the piece that ran out of memory cannot be cut into pieces it takes
                    run.failure = _Failure(_OOM, start, stop, redoing, rejected)
                else:  # a remainder: the pieces before it are accumulated already
                    run.failure = _Failure(_SIZE, position, end, message, rejected)
                return size
            run.oom_errors.append(message)
            release_memory()
            if end - position < 2 * self.min_size:
                run.failure = _Failure(_OOM, position, end, message)
                return size
            # redo the failed piece smaller; `end` stays a boundary, so gradient coverage lines up
            size = self._run_range(run, parameters, position, end, self._redo_size(end - position), redoing=message)
            if run.failure is not None:
                return size
            position = end
        return size

    def _redo_size(self, failed: int) -> int:
        """The size to redo ``failed`` (≥ 2 · ``min_size``) samples with: ``shrink``'s, at a multiple of the minimum.

        A multiple keeps the pieces' boundaries in step with the minimum: 18 samples of a model that
        takes no fewer than 2, and fits no more, go 10 → 6 → 4 → 2 and never leave a piece of 3.
        """
        smaller, least = self._smaller(failed), self.min_size
        rounded = -(-smaller // least) * least
        return rounded if rounded < failed else max(smaller // least * least, least)

    def _smaller(self, size: int) -> int:
        smaller = self.shrink(size)
        if isinstance(smaller, bool) or not isinstance(smaller, int) or not 1 <= smaller < size:
            raise ValueError(f"`shrink`({size}) returned {smaller!r}; it must return an int in [1, {size - 1}]")
        return smaller

    def _learn(self, rejected: int, message: str) -> None:
        self.min_size = self.learned_min_size = rejected + 1
        self.min_size_reason = self.learned_min_size_reason = (
            f"a micro-batch of {_samples(rejected)} raised {_shorten(message)}"
        )

    def _rejects_size(self, run: _Run, error: Exception, samples: int, largest_before: int) -> bool:
        """Whether a non-OOM ``error`` on a piece of ``samples`` says the model does not take so few."""
        if isinstance(error, BatchSplitError) or samples >= largest_before:
            return False  # the first size tried (or a larger one) failing is a bug in the step, not a size
        return run.smallest_done is None or samples < run.smallest_done  # a size that ran is taken

    def _run_chunk(
        self, run: _Run, parameters: list[nn.Parameter], start: int, stop: int
    ) -> tuple[str, Exception | None] | None:
        """Run samples ``start:stop``: ``None``, or the error's message and, for a size error, the error itself.

        The buffers are put back after an error. An out-of-memory error is not kept: its traceback
        holds the failed piece's tensors.
        """
        # parameters whose gradient already holds these samples (from a backward that failed later on)
        done = [p.register_hook(_no_gradient) for i, p in enumerate(parameters) if run.covered[i] >= stop]
        run.chunk_end = stop
        largest_before, run.largest_tried = run.largest_tried, max(run.largest_tried, stop - start)
        snapshot: dict[str, torch.Tensor] = {}
        try:
            if run.backward is not None and not self.lockstep:  # batch-norm statistics, put back if the piece fails
                snapshot = {name: buffer.clone() for name, buffer in self.module.named_buffers()}
            self._forward_backward(run, _piece(run, start, stop), stop - start)
        except Exception as error:
            if self.lockstep:
                raise
            oom = is_oom_error(error)
            if not oom and not self._rejects_size(run, error, stop - start, largest_before):
                raise
            caught = f"{type(error).__name__}: {error}", None if oom else error
        else:
            run.smallest_done = stop - start if run.smallest_done is None else min(run.smallest_done, stop - start)
            return None
        finally:
            for handle in done:
                handle.remove()
        for name, saved in snapshot.items():  # by name: a forward may have assigned a new tensor
            self.module.get_buffer(name).copy_(saved)
        return caught

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

    def _failure_error(self, run: _Run, failed: int) -> tuple[Exception, BaseException | None]:
        """The error every rank raises when some rank's batch failed (``failed``: the agreed kind), and its cause."""
        failure = run.failure
        if failure is None:
            if failed == _SIZE:
                return MicroBatchSizeError(
                    "AdaptiveAccumulation: another rank ran a micro-batch smaller than the model takes; every rank "
                    f"stops together. Later batches are cut into micro-batches of at least {self.min_size} samples",
                    min_size=self.min_size,
                ), None
            return SampleOutOfMemoryError(
                "AdaptiveAccumulation: another rank ran out of memory on a piece it cannot split further; "
                "every rank stops together"
            ), None
        samples = failure.stop - failure.start
        if failure.kind == _SIZE:
            return MicroBatchSizeError(
                f"AdaptiveAccumulation: a micro-batch of {_samples(samples)} raised {_shorten(failure.message)}, "
                f"after larger micro-batches ran: the model takes no fewer than {self.min_size} samples. This batch "
                "cannot be completed (its earlier micro-batches are accumulated already); later batches are cut into "
                f"micro-batches of at least {self.min_size} samples",
                size=samples,
                min_size=self.min_size,
            ), failure.cause
        if run.unsplittable is not None:
            return SampleOutOfMemoryError(
                f"AdaptiveAccumulation: the batch ran out of memory ({failure.message}) and cannot be split into "
                f"micro-batches: {run.unsplittable}",
                sample=run.batch,
            ), failure.cause
        least, why = self.min_size, f" ({self.min_size_reason})" if self.min_size_reason else ""
        if samples == least == 1:
            what = "a micro-batch of one sample does not fit"
        elif samples == least:
            what = f"a micro-batch of {samples} samples, the smallest the model takes{why}, does not fit"
        elif samples > least:
            what = (
                f"a micro-batch of {samples} samples does not fit, and it cannot be cut into micro-batches of at "
                f"least {least} samples, the smallest the model takes{why}"
            )
        else:
            what = f"a batch of {_samples(samples)} does not fit, and the model takes no fewer than {least}{why}"
        return SampleOutOfMemoryError(
            f"AdaptiveAccumulation: {what} ({failure.message})",
            sample=_piece(run, failure.start, failure.stop),
            size=samples,
        ), failure.cause

    def _result(self, run: _Run, size: int, recovered: bool, flags: list[int]) -> MicroBatchResult:
        loss = torch.stack(run.losses).sum() if run.losses and run.backward is not None else None
        output = merge_outputs(run.outputs, run.sizes)
        if loss is not None and len(run.outputs) > 1:
            output = with_loss(output, loss)
        return MicroBatchResult(output, loss, run.sizes, size, recovered, run.oom_errors, flags)


def _samples(count: int) -> str:
    return "1 sample" if count == 1 else f"{count} samples"


def _shorten(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


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
