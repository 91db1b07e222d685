"""MemoptFSDPStrategy: full sharding per model block, those blocks checkpointed, a bf16 mixed-precision policy."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import CustomPolicy
from typing_extensions import override

from lightning_memopt.models.structure import ModelStructure, model_structure

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


class ModelBlocks:
    """An FSDP policy function: whether a module is one of the blocks of the model last given to :meth:`find`.

    The blocks are those the model declares, else the repeated blocks discovered in it
    (:func:`~lightning_memopt.models.structure.model_structure`); with ``sharded``, only those
    holding parameters (a unit with nothing to shard is no unit).

    Example::

        >>> from lightning_memopt.models import create_model
        >>> model = create_model("sapiens_tiny")
        >>> units = ModelBlocks(sharded=True)
        >>> units.find(model).describe_blocks()
        '8 blocks (ViTBlock ×2, ConvNormAct ×6; declared)'
        >>> units(model.backbone.blocks[0]), units(model.backbone)
        (True, False)
    """

    def __init__(self, sharded: bool = False) -> None:
        self.sharded = sharded
        self.ids: set[int] = set()

    def find(self, model: nn.Module) -> ModelStructure:
        """Find the blocks of ``model``; returns its structure."""
        structure = model_structure(model)
        self.use(structure)
        return structure

    def use(self, structure: ModelStructure) -> None:
        """Take the blocks of a model's ``structure``."""
        blocks = structure.blocks
        if self.sharded:
            blocks = [(name, block) for name, block in blocks if next(block.parameters(), None) is not None]
        self.ids = {id(block) for _, block in blocks}

    def __call__(self, module: nn.Module) -> bool:
        return id(module) in self.ids


class MemoptFSDPStrategy(FSDPStrategy):
    """FSDP for the big models (Sapiens 0.3b–2b): full sharding, one unit per model block, checkpointed blocks.

    - ``sharding_strategy="FULL_SHARD"``: parameters, gradients and optimizer state split over all ranks.
    - ``auto_wrap_policy``: each block of the model its own FSDP unit, so only one block's full
      parameters exist at a time. The blocks are those the model declares (ViT blocks and
      normal-head stages in Sapiens), else the repeated blocks discovered in it, found when the
      strategy wraps the model (:class:`ModelBlocks`).
    - ``activation_checkpointing_policy``: the same blocks (``checkpointing=False`` turns it off).
    - ``mixed_precision``: parameters in ``param_dtype`` (``"bf16"``) for compute, gradients
      reduced and buffers kept in fp32 (:func:`mixed_precision_policy`).
    - ``state_dict_type="sharded"``: each rank writes its shard (no full gather at save).

    Registered name: ``fsdp_memopt``. Other keyword arguments go to Lightning's ``FSDPStrategy``.

    Raises:
        MisconfigurationException: for an unknown ``param_dtype``.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> strategy = MemoptFSDPStrategy()
        >>> strategy.find_blocks(create_model("sapiens_tiny")).describe_blocks()
        '8 blocks (ViTBlock ×2, ConvNormAct ×6; declared)'
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
        self.shard_units = ModelBlocks(sharded=True)
        self.checkpointed_blocks = ModelBlocks()
        kwargs.setdefault("auto_wrap_policy", CustomPolicy(self.shard_units))
        if checkpointing:
            kwargs.setdefault("activation_checkpointing_policy", CustomPolicy(self.checkpointed_blocks))
        if mixed_precision is not None:
            kwargs.setdefault("mixed_precision", mixed_precision)
        super().__init__(sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, **kwargs)  # type: ignore[arg-type]
        self.param_dtype = param_dtype

    def find_blocks(self, model: nn.Module) -> ModelStructure:
        """Find the FSDP units and checkpointed blocks of ``model`` (done when the strategy wraps it)."""
        structure = model_structure(model)
        self.checkpointed_blocks.use(structure)
        self.shard_units.use(structure)
        return structure

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        structure = self.find_blocks(model)
        if structure.blocks:
            rank_zero_info(f"fsdp_memopt: one FSDP unit and checkpoint per block: {structure.describe_blocks()}")
        else:
            rank_zero_warn(
                "fsdp_memopt: the model declares no blocks and none were discovered, so it is one FSDP unit (every "
                "parameter gathered at once) and nothing is checkpointed; give `auto_wrap_policy` and "
                "`activation_checkpointing_policy` (sets of block classes)"
            )
        return super()._setup_model(model)
