"""Micro-batching: split a batch, run it in pieces that fit, recover from out-of-memory errors."""

from lightning_memopt.accumulation.micro_batch import (
    LOSS_REDUCTIONS,
    MicroBatchResult,
    MicroBatchRunner,
    MicroBatchSizeError,
    RanksOutOfStepError,
    SampleOutOfMemoryError,
    batch_norms,
    halve,
    min_micro_batch_size,
)
from lightning_memopt.accumulation.split import (
    BatchSplitError,
    batch_size,
    merge_outputs,
    register_batch_type,
    slice_batch,
)

__all__ = [
    "LOSS_REDUCTIONS",
    "BatchSplitError",
    "MicroBatchResult",
    "MicroBatchRunner",
    "MicroBatchSizeError",
    "RanksOutOfStepError",
    "SampleOutOfMemoryError",
    "batch_size",
    "halve",
    "merge_outputs",
    "batch_norms",
    "min_micro_batch_size",
    "register_batch_type",
    "slice_batch",
]
