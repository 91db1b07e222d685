"""Measuring and simulating memory: knows nothing of Lightning callbacks, the CLI or the tasks."""

from lightning_memopt.memory.allocator import SimulatedDevice, is_oom_error, release_memory
from lightning_memopt.memory.profile import MemoryProfile, TensorInfo, profile_step
from lightning_memopt.memory.tracker import CATEGORIES, MemorySnapshot, MemoryTracker, StorageRecord, host_memory

__all__ = [
    "CATEGORIES",
    "MemoryProfile",
    "MemorySnapshot",
    "MemoryTracker",
    "SimulatedDevice",
    "StorageRecord",
    "TensorInfo",
    "host_memory",
    "is_oom_error",
    "profile_step",
    "release_memory",
]
