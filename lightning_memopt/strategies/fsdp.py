"""MemoptFSDPStrategy: full sharding per ViT block, checkpointed preset blocks, a bf16 mixed-precision policy."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from lightning_memopt.checkpointing import PRESET_BLOCKS
from lightning_memopt.selection import resolve_class

SHARDED_BLOCKS = ("lightning_memopt.models.vit.ViTBlock",)  # one FSDP unit per transformer block
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def mixed_precision_policy(param_dtype: str) -> MixedPrecision | None:
    """Parameters gathered and computed in ``param_dtype``; gradients reduced and buffers kept in fp32.

    Raises:
        ValueError: for a ``param_dtype`` other than ``"bf16"``, ``"fp16"``, ``"fp32"`` (no policy).

    Example::

        >>> mixed_precision_policy("bf16").reduce_dtype
        torch.float32
    """
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"Unknown `param_dtype`={param_dtype!r}; valid choices: {', '.join(PARAM_DTYPES)}")
    dtype = PARAM_DTYPES[param_dtype]
    if dtype is None:
        return None
    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def block_classes(paths: tuple[str, ...]) -> set[type[nn.Module]]:
    """The module classes at dotted ``paths``."""
    return {resolve_class(path) for path in paths}


class MemoptFSDPStrategy(FSDPStrategy):
    """FSDP for the big ViT presets (Sapiens 0.3b–2b): full sharding, one unit per ViT block, checkpointed blocks.

    - ``sharding_strategy="FULL_SHARD"``: parameters, gradients and optimizer state split over all ranks.
    - ``auto_wrap_policy``: each :class:`~lightning_memopt.models.vit.ViTBlock` its own FSDP unit, so
      only one block's full parameters exist at a time.
    - ``activation_checkpointing_policy``: the blocks of ActivationCheckpointing's ``"preset"`` policy
      (``checkpointing=False`` turns it off).
    - ``mixed_precision``: parameters in ``param_dtype`` (``"bf16"``) for compute, gradients
      reduced and buffers kept in fp32 (:func:`mixed_precision_policy`).
    - ``state_dict_type="sharded"``: each rank writes its shard (no full gather at save).

    Registered name: ``fsdp_memopt``. Other keyword arguments go to Lightning's ``FSDPStrategy``.

    Raises:
        MisconfigurationException: for an unknown ``param_dtype``.

    Example::

        >>> strategy = MemoptFSDPStrategy()
        >>> sorted(cls.__name__ for cls in strategy.sharded_blocks)
        ['ViTBlock']
    """

    def __init__(
        self,
        param_dtype: str = "bf16",
        checkpointing: bool = True,
        sharding_strategy: str = "FULL_SHARD",
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ) -> None:
        try:
            mixed_precision = mixed_precision_policy(param_dtype)
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None
        self.sharded_blocks = block_classes(SHARDED_BLOCKS)
        kwargs.setdefault("auto_wrap_policy", self.sharded_blocks)
        if checkpointing:
            kwargs.setdefault("activation_checkpointing_policy", block_classes(PRESET_BLOCKS))
        if mixed_precision is not None:
            kwargs.setdefault("mixed_precision", mixed_precision)
        super().__init__(sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, **kwargs)  # type: ignore[arg-type]
        self.param_dtype = param_dtype
