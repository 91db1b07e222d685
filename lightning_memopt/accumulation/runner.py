"""MicroBatchRunner: run one batch in micro-batches, and recover from out-of-memory by splitting it further.

One algorithm (cut, run, retry smaller, agree with the other ranks) sharing the state of one run, with the
record of which samples each parameter's gradient already holds (:class:`GradientCoverage`). How a batch is
cut and the smallest size a model takes are in :mod:`.sizing`, what a failed batch raises in :mod:`.errors`,
ranks in lockstep in :mod:`.lockstep`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_memopt.accumulation.errors import OOM, SIZE, Failure, count_samples, failure_error, shorten
from lightning_memopt.accumulation.lockstep import check_same_pieces
from lightning_memopt.accumulation.sizing import Shrink, check_min_size, halve, next_piece, redo_size
from lightning_memopt.batch_slicing import BatchSplitError, batch_size, loss_of, merge_outputs, slice_batch, with_loss
from lightning_memopt.memory.allocator import is_oom_error, release_memory
from lightning_memopt.random_generators import capture_random_state, restore_random_state

LOSS_REDUCTIONS = ("mean", "sum")
LossReduction = Literal["mean", "sum"]  # == LOSS_REDUCTIONS
Agree = Callable[[list[int]], list[int]]


def check_loss_reduction(loss_reduction: str) -> None:
    """Raise ``ValueError`` unless ``loss_reduction`` is ``"mean"`` or ``"sum"``."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"Unknown `loss_reduction`={loss_reduction!r}; valid choices: {', '.join(LOSS_REDUCTIONS)}")


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
    coverage: GradientCoverage
    outputs: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    oom_errors: list[str] = field(default_factory=list)
    unsplittable: BatchSplitError | None = None  # why the batch can only run whole
    largest_tried: int = 0  # the largest piece attempted on this rank, fitting or not
    smallest_done: int | None = None  # the smallest piece that completed on this rank
    failure: Failure | None = None  # what stopped this batch on this rank


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
        parameters = [p for p in self.module.parameters() if p.requires_grad] if backward is not None else []
        run = _Run(batch, total, step, backward, weight, GradientCoverage(parameters), unsplittable=unsplittable)
        if self.lockstep:
            check_same_pieces(self._agree, total, size, self.min_size)
        agreed_flags, recovered, position = list(flags), False, 0
        with run.coverage:
            while True:
                if position < total and run.failure is None:
                    end = position + next_piece(total - position, size, self.min_size)
                    size = self._run_range(run, position, end, size)
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
                    piece = None if failure is None else _piece(run, failure.start, failure.stop)
                    error, cause = failure_error(
                        failure, failed, self.min_size, self.min_size_reason, run.unsplittable, run.batch, piece
                    )
                    raise error from cause
                size = -negative_size
                if not unfinished:
                    break
        return self._result(run, size, recovered, agreed_flags)

    def _agree(self, values: list[int]) -> list[int]:
        return values if self.agree is None else [int(v) for v in self.agree(values)]

    def _run_range(self, run: _Run, start: int, stop: int, size: int, redoing: str | None = None) -> int:
        """Samples ``start:stop`` in pieces of ``size``, smaller after a failure; the size it ends with.

        ``redoing`` is the out-of-memory error of ``start:stop`` when it is being redone in smaller
        pieces. What stops the batch is left in ``run.failure``.
        """
        position = start
        while position < stop:
            end = position + next_piece(stop - position, size, self.min_size)
            caught = self._run_chunk(run, position, end)
            if caught is None:
                position = end
                continue
            message, rejected = caught
            if rejected is not None:  # a size the model rejects (any other error was raised as it is)
                self._learn(end - position, message)
                if redoing is not None:  # the piece that ran out of memory cannot be cut into pieces it takes
                    run.failure = Failure(OOM, start, stop, redoing, rejected)
                else:  # a remainder: the pieces before it are accumulated already
                    run.failure = Failure(SIZE, position, end, message, rejected)
                return size
            run.oom_errors.append(message)
            release_memory()
            if end - position < 2 * self.min_size:
                run.failure = Failure(OOM, position, end, message)
                return size
            # redo the failed piece smaller; `end` stays a boundary, so gradient coverage lines up
            smaller = redo_size(end - position, self.shrink, self.min_size)
            size = self._run_range(run, position, end, smaller, redoing=message)
            if run.failure is not None:
                return size
            position = end
        return size

    def _learn(self, rejected: int, message: str) -> None:
        self.min_size = self.learned_min_size = rejected + 1
        self.min_size_reason = self.learned_min_size_reason = (
            f"a micro-batch of {count_samples(rejected)} raised {shorten(message)}"
        )

    def _rejects_size(self, run: _Run, error: Exception, samples: int, largest_before: int) -> bool:
        """Whether a non-OOM ``error`` on a piece of ``samples`` says the model does not take so few."""
        if isinstance(error, BatchSplitError) or samples >= largest_before:
            return False  # the first size tried (or a larger one) failing is a bug in the step, not a size
        return run.smallest_done is None or samples < run.smallest_done  # a size that ran is taken

    def _run_chunk(self, run: _Run, start: int, stop: int) -> tuple[str, Exception | None] | None:
        """Run samples ``start:stop``: ``None``, or the error's message and, for a size error, the error itself.

        The buffers and the random generators are put back after an error, so the pieces that redo
        it draw what it would have drawn. An out-of-memory error is not kept: its traceback holds the
        failed piece's tensors.
        """
        largest_before, run.largest_tried = run.largest_tried, max(run.largest_tried, stop - start)
        snapshot: dict[str, torch.Tensor] = {}
        random_state = None if self.lockstep else capture_random_state()  # lockstep raises: nothing is redone
        try:
            # parameters whose gradient already holds these samples (from a backward that failed later on) take none
            with run.coverage.piece(stop):
                if run.backward is not None and not self.lockstep:  # batch-norm statistics, put back on failure
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
        for name, saved in snapshot.items():  # by name: a forward may have assigned a new tensor
            self.module.get_buffer(name).copy_(saved)
        if random_state is not None:
            restore_random_state(random_state)
        return caught

    def _forward_backward(self, run: _Run, chunk: Any, samples: int) -> None:
        output = run.step(chunk)
        loss = loss_of(output)
        share = samples / run.total if self.loss_reduction == "mean" else 1.0
        if run.backward is not None:
            if loss is not None:
                run.backward(loss * (share * run.weight))
            output = apply_to_collection(output, torch.Tensor, torch.Tensor.detach)  # no graph outlives its piece
        run.outputs.append(output)
        run.sizes.append(samples)
        if loss is not None:
            run.losses.append(loss.detach() * share)

    def _result(self, run: _Run, size: int, recovered: bool, flags: list[int]) -> MicroBatchResult:
        loss = torch.stack(run.losses).sum() if run.losses and run.backward is not None else None
        output = merge_outputs(run.outputs, run.sizes)
        if loss is not None and len(run.outputs) > 1:
            output = with_loss(output, loss)
        return MicroBatchResult(output, loss, run.sizes, size, recovered, run.oom_errors, flags)


def _piece(run: _Run, start: int, stop: int) -> Any:
    if run.unsplittable is not None or (start, stop) == (0, run.total):
        return run.batch
    return slice_batch(run.batch, start, stop)


class GradientCoverage:
    """Track which samples each parameter's gradient holds, while the context is open.

    Args:
        parameters: the parameters that take gradients.

    Example::

        >>> layer = nn.Linear(2, 1)
        >>> with GradientCoverage(list(layer.parameters())) as coverage:
        ...     for _ in range(2):  # the same samples twice: the second adds nothing
        ...         with coverage.piece(3):
        ...             layer(torch.ones(3, 2)).sum().backward()
        >>> layer.bias.grad, coverage.covered
        (tensor([3.]), [3, 3])
    """

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        self.covered = [0] * len(parameters)  # per parameter: its gradient holds samples [0, covered)
        self._end = 0  # the end of the piece running now
        self._handles: list[Any] = []

    def __enter__(self) -> GradientCoverage:
        self._handles = [p.register_post_accumulate_grad_hook(self._landed(i)) for i, p in enumerate(self.parameters)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def piece(self, stop: int) -> Iterator[None]:
        """Run the piece that ends at sample ``stop``: parameters already holding it take a zero gradient."""
        done = [p.register_hook(_no_gradient) for i, p in enumerate(self.parameters) if self.covered[i] >= stop]
        self._end = stop
        try:
            yield
        finally:
            for handle in done:
                handle.remove()

    def _landed(self, index: int) -> Callable[[torch.Tensor], None]:
        def landed(parameter: torch.Tensor) -> None:
            self.covered[index] = max(self.covered[index], self._end)  # a skipped (zero) gradient also lands here

        return landed


def _no_gradient(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)
