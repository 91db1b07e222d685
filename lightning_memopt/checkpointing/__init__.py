"""Activation checkpointing injected into any model: policies, selective recomputation, host offload.

Example::

    >>> from lightning_memopt.checkpointing import apply_activation_checkpointing
    >>> from lightning_memopt.models import create_model
    >>> blocks = "backbone.blocks.*"  # every second ViT block recomputed, the others offloaded
    >>> policy = [{"modules": blocks, "every_n": 2}, {"modules": blocks, "mode": "offload"}]
    >>> apply_activation_checkpointing(create_model("sapiens_tiny", depth=4), policy)
    4
"""

from lightning_memopt.checkpointing.offload import (
    MIN_OFFLOAD_BYTES,
    OffloadStats,
    PrefetchSchedule,
    offload_stats,
    offload_to_host,
    release_offload_buffers,
)
from lightning_memopt.checkpointing.offload_copies import PinnedBufferPool
from lightning_memopt.checkpointing.policy import (
    ActivationBudget,
    BlocksSpec,
    Policy,
    PolicySpec,
    check_blocks,
    parse_policy,
)
from lightning_memopt.checkpointing.selective import SAVED_OP_NAMES, SAVED_OPS, selective_context
from lightning_memopt.checkpointing.wrap import (
    CheckpointReport,
    apply_activation_checkpointing,
    checkpoint_mode,
    checkpoint_modules,
    remove_activation_checkpointing,
)
from lightning_memopt.models.structure import LeanRecompute, lean_recompute
from lightning_memopt.vocabulary import CHECKPOINT_MODES, CheckpointMode

__all__ = [
    "ActivationBudget",
    "CHECKPOINT_MODES",
    "SAVED_OPS",
    "SAVED_OP_NAMES",
    "BlocksSpec",
    "CheckpointMode",
    "CheckpointReport",
    "LeanRecompute",
    "MIN_OFFLOAD_BYTES",
    "OffloadStats",
    "PinnedBufferPool",
    "Policy",
    "PolicySpec",
    "PrefetchSchedule",
    "apply_activation_checkpointing",
    "check_blocks",
    "checkpoint_mode",
    "checkpoint_modules",
    "lean_recompute",
    "offload_stats",
    "offload_to_host",
    "parse_policy",
    "release_offload_buffers",
    "remove_activation_checkpointing",
    "selective_context",
]
