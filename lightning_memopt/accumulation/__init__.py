"""Micro-batching: split a batch, run it in pieces that fit, recover from out-of-memory errors.

Everything here runs without a Trainer: :class:`TrainingRecovery` and :class:`EvaluationChunks` are
what :class:`~lightning_memopt.AdaptiveAccumulation` does for a training or evaluation batch, over the
:class:`MicroBatchRunner`; :func:`deliver` hands the accumulated gradients to a loop's own backward.
"""

from lightning_memopt.accumulation.errors import (
    MicroBatchSizeError,
    RanksOutOfStepError,
    SampleOutOfMemoryError,
    with_profile,
)
from lightning_memopt.accumulation.evaluation import EvaluationChunks
from lightning_memopt.accumulation.lockstep import Lockstep
from lightning_memopt.accumulation.runner import LOSS_REDUCTIONS, MicroBatchResult, MicroBatchRunner
from lightning_memopt.accumulation.sizing import MicroBatchSizer, batch_norms, halve, min_micro_batch_size
from lightning_memopt.accumulation.training import TrainingRecovery, deliver, scaled_backward
from lightning_memopt.batch_slicing import (
    BatchSplitError,
    batch_size,
    merge_outputs,
    register_batch_type,
    slice_batch,
)

__all__ = [
    "LOSS_REDUCTIONS",
    "BatchSplitError",
    "EvaluationChunks",
    "Lockstep",
    "MicroBatchResult",
    "MicroBatchRunner",
    "MicroBatchSizeError",
    "MicroBatchSizer",
    "RanksOutOfStepError",
    "SampleOutOfMemoryError",
    "TrainingRecovery",
    "batch_norms",
    "batch_size",
    "deliver",
    "halve",
    "merge_outputs",
    "min_micro_batch_size",
    "register_batch_type",
    "scaled_backward",
    "slice_batch",
    "with_profile",
]
