"""EvaluationChunks: evaluate a batch whole, or in chunks after an out-of-memory error, with the same outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memopt.accumulation.errors import log_info
from lightning_memopt.accumulation.lockstep import Lockstep
from lightning_memopt.accumulation.runner import MicroBatchRunner
from lightning_memopt.accumulation.sizing import Shrink, batch_norms, halve, update_min_size
from lightning_memopt.batch_slicing import batch_size_or_none


class EvaluationChunks:
    """Run evaluation steps (validation, test, predict) whole, and in chunks once a batch ran out of memory.

    The chunks' outputs are merged (per-sample tensors and lists concatenated, scalars averaged by
    chunk size), so metrics see every sample once. The chunk size that worked is kept for later
    batches. Each rank chunks on its own, without collectives; in lockstep (FSDP), where a step's
    forward is collectives, batches run whole and an out-of-memory error stops every rank.

    Args:
        shrink: ``size -> smaller size`` after an out-of-memory error (default: halve).
        micro_batch_size: the chunk size to start with (``None``: whole batches), e.g. a checkpoint's.

    Example::

        >>> import torch
        >>> model = nn.Linear(4, 2)
        >>> def step(x):
        ...     if len(x) > 3:
        ...         raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        ...     return model(x)
        >>> chunks = EvaluationChunks()
        >>> chunks.attach(model)
        >>> chunks.run(step, torch.randn(10, 4)).shape, chunks.micro_batch_size  # 10 → 5 → 3
        (torch.Size([10, 2]), 3)
    """

    def __init__(self, shrink: Shrink = halve, micro_batch_size: int | None = None) -> None:
        self.shrink = shrink
        self.micro_batch_size = micro_batch_size  # the chunk size that worked (saved in checkpoints)
        self.runner: MicroBatchRunner | None = None
        self.lockstep: Lockstep | None = None
        self._norms: list[nn.Module] | None = None  # the module's batch norms, listed at its first batch

    def attach(self, module: nn.Module, lockstep: Lockstep | None = None) -> None:
        """Run ``module``'s evaluation batches from now on (the chunk size is kept); ``lockstep``: under FSDP."""
        self.runner = MicroBatchRunner(module, self.shrink)
        self.lockstep, self._norms = lockstep, None

    def run(self, step: Callable[[Any], Any], batch: Any, hook: str = "validation_step") -> Any:
        """``step`` on ``batch`` (``step(batch_or_chunk) -> output``), in chunks after an out-of-memory error.

        Args:
            step: the evaluation step on one chunk (or the whole batch).
            batch: the batch; one that cannot be split runs whole.
            hook: the step's name, for the messages.

        Raises:
            SampleOutOfMemoryError: when a chunk of one sample (or a batch that cannot be split) does not fit.
            RanksOutOfStepError: in lockstep, after an out-of-memory error on this or another rank.
        """
        if self.runner is None:
            raise RuntimeError("EvaluationChunks runs batches once attached to a module: call `attach(module)` first")
        if self._norms is None:
            self._norms = batch_norms(self.runner.module)
        update_min_size(self.runner, self._norms)  # in eval mode batch norm takes one sample
        total = batch_size_or_none(batch)
        if self.lockstep is not None:  # whole batches: chunks after an error would leave the ranks out of step
            with self.lockstep.stop_every_rank_on_error(hook, None, total):
                return step(batch)
        size = None if total is None else self.micro_batch_size
        result = self.runner.run(step, batch, size)
        if result.recovered:
            self.micro_batch_size = result.micro_batch_size
            log_info(
                f"AdaptiveAccumulation: out of memory in {hook}; batches of {total} are evaluated in chunks of "
                f"{result.micro_batch_size} from now on"
            )
        return result.output
