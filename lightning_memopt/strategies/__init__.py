"""Registered strategy names: ``Trainer(strategy="ddp_powersgd")`` once this module is imported.

``ddp_memopt``, ``ddp_powersgd``, ``ddp_fp16_compress``, ``ddp_bf16_compress`` and ``fsdp_memopt`` are in
Lightning's ``StrategyRegistry`` once ``lightning_memopt`` and Lightning are both imported
(:mod:`lightning_memopt.registration`); importing this module registers them too.

Example::

    >>> import lightning_memopt.strategies
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "ddp_powersgd" in StrategyRegistry and "fsdp_memopt" in StrategyRegistry
    True
"""

from lightning_memopt.registration import register_strategy_names
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

register_strategy_names()  # the names build these classes (lightning_memopt.registration)
