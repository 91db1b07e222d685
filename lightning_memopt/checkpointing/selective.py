"""Selective recomputation: keep the outputs of expensive ops, recompute the cheap ones.

Matmuls, convolutions and attention kernels cost most to recompute and their outputs are what
the next op needs; element-wise and normalisation ops are cheap to redo but hold as many bytes.
Saving the first and recomputing the second keeps most of the memory saving of full
checkpointing for a fraction of its extra time (Korthikanti et al. 2022).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in SAVED_OP_NAMES if hasattr(torch.ops.aten, name))


def save_expensive_ops(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: save the outputs of :data:`SAVED_OPS`, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that applies :func:`save_expensive_ops`.

    Example::

        >>> from torch.utils.checkpoint import checkpoint
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> weight = torch.randn(8, 8, requires_grad=True)
        >>> out = checkpoint(lambda a: (a @ weight).relu(), x, use_reentrant=False, context_fn=selective_context)
        >>> out.sum().backward()
        >>> torch.equal(x.grad, ((x @ weight) > 0).float() @ weight.T)
        True
    """
    return create_selective_checkpoint_contexts(save_expensive_ops)
