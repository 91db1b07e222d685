"""Lightning callbacks, each thin over the functional layer."""

from lightning_memopt.callbacks.accumulation_scheduler import AccumulationSchedule, StepAccumulationScheduler
from lightning_memopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memopt.callbacks.adaptive_accumulation import AdaptiveAccumulation
from lightning_memopt.callbacks.compiled_step import CompiledStep
from lightning_memopt.callbacks.memory_budget import MemoryBudget
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.callbacks.precision_switch import PrecisionSwitch
from lightning_memopt.callbacks.resume import LastCheckpoint, RandomStateCheckpoint
from lightning_memopt.callbacks.training_summary import FitSummary, TrainingSummary
from lightning_memopt.callbacks.validation_interval import ValidationWithinEpoch

__all__ = [
    "AccumulationSchedule",
    "ActivationCheckpointing",
    "AdaptiveAccumulation",
    "CompiledStep",
    "FitSummary",
    "LastCheckpoint",
    "MemoryBudget",
    "MemoryMonitor",
    "PrecisionSwitch",
    "RandomStateCheckpoint",
    "StepAccumulationScheduler",
    "TrainingSummary",
    "ValidationWithinEpoch",
]
