"""Registered strategy names: ``Trainer(strategy="ddp_powersgd")`` once this module is imported.

Importing it registers ``ddp_memopt``, ``ddp_powersgd``, ``ddp_fp16_compress``, ``ddp_bf16_compress`` and
``fsdp_memopt`` in Lightning's ``StrategyRegistry``; the first use of any public name of
``lightning_memopt`` imports it too.

Example::

    >>> import lightning_memopt.strategies
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "ddp_powersgd" in StrategyRegistry and "fsdp_memopt" in StrategyRegistry
    True
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_memopt.strategies.comm_hooks import COMM_HOOKS, comm_hook
from lightning_memopt.strategies.consolidate import consolidate_checkpoint, is_sharded_checkpoint
from lightning_memopt.strategies.ddp import POWERSGD_KEY, MemoptDDPStrategy
from lightning_memopt.strategies.fsdp import MemoptFSDPStrategy, mixed_precision_policy
from lightning_memopt.strategies.sharding import ShardingError, shard_model, shard_units

__all__ = [
    "COMM_HOOKS",
    "POWERSGD_KEY",
    "MemoptDDPStrategy",
    "MemoptFSDPStrategy",
    "ShardingError",
    "comm_hook",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "mixed_precision_policy",
    "shard_model",
    "shard_units",
]

_DDP_PRESETS = {
    "ddp_memopt": ("DDP with gradient buckets as views, static graph under activation checkpointing", "none"),
    "ddp_powersgd": ("ddp_memopt + PowerSGD gradient compression (rank 1, error feedback)", "powersgd"),
    "ddp_fp16_compress": ("ddp_memopt + gradients all-reduced in fp16", "fp16"),
    "ddp_bf16_compress": ("ddp_memopt + gradients all-reduced in bf16", "bf16"),
}
for _name, (_description, _hook) in _DDP_PRESETS.items():
    StrategyRegistry.register(_name, MemoptDDPStrategy, description=_description, override=True, comm_hook=_hook)
StrategyRegistry.register(
    "fsdp_memopt",
    MemoptFSDPStrategy,
    description="FSDP2: a unit per model block, bf16 gathers under bf16-mixed, optional CPU offload",
    override=True,
)
