"""Activation checkpointing injected into any model: policies, selective recomputation, host offload.

Example::

    >>> from lightning_memopt.checkpointing import apply_activation_checkpointing
    >>> from lightning_memopt.models import create_model
    >>> apply_activation_checkpointing(create_model("sapiens_tiny"), [{"every_n": 2}, {"mode": "offload"}])
    2
"""

from lightning_memopt.checkpointing.offload import offload_to_host
from lightning_memopt.checkpointing.policy import MODES, PRESET_BLOCKS, Policy, parse_policy
from lightning_memopt.checkpointing.selective import SAVED_OPS, selective_context
from lightning_memopt.checkpointing.wrap import (
    CheckpointReport,
    apply_activation_checkpointing,
    checkpoint_mode,
    checkpoint_modules,
    remove_activation_checkpointing,
)

__all__ = [
    "MODES",
    "PRESET_BLOCKS",
    "SAVED_OPS",
    "CheckpointReport",
    "Policy",
    "apply_activation_checkpointing",
    "checkpoint_mode",
    "checkpoint_modules",
    "offload_to_host",
    "parse_policy",
    "remove_activation_checkpointing",
    "selective_context",
]
