"""Memory-lean recomputation of conv → InstanceNorm2d → activation stages: channel chunks (here), spatial tiles.

Checkpointed whole, a full-resolution stage rematerialises in backward its conv output, its
normalised output and the activation's gradient, each as large as the stage's output. Two leaner
recomputations keep only a fraction of that live at once:

* :func:`chunked_conv_norm_act` computes one stage in chunks of its output channels, each chunk
  checkpointed on its own (instance norm's statistics are per channel, so chunks are independent):
  backward rematerialises one chunk at a time.
* :func:`~lightning_memopt.models.tiled_chain.tiled_conv_norm_act_chain` runs a chain of 1×1 stages
  over tiles of rows, gathering each instance norm's whole-map statistics in passes over the tiles.

Both use only public ``torch.nn.functional`` ops; hooks of the stages' submodules do not fire on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# activations that act element by element and hold no parameters: safe to apply per chunk or tile
ELEMENTWISE_ACTIVATIONS = (
    nn.SiLU,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.Identity,
)

Stage = tuple[nn.Module, nn.Module, nn.Module]  # (conv, norm, activation)


def input_statistics_norm(norm: nn.Module) -> bool:
    """An InstanceNorm2d that normalises by the input's statistics only (no running statistics)."""
    return isinstance(norm, nn.InstanceNorm2d) and not norm.track_running_stats


def elementwise_activation(act: nn.Module) -> bool:
    """A parameter-free activation of :data:`ELEMENTWISE_ACTIVATIONS`: it may run per channel chunk or tile."""
    return isinstance(act, ELEMENTWISE_ACTIVATIONS) and not any(True for _ in act.parameters())


def can_chunk(stage: Sequence[nn.Module]) -> bool:
    """Whether :func:`chunked_conv_norm_act` can run ``(conv, norm, activation)``.

    Example::

        >>> can_chunk((nn.Conv2d(4, 4, 1), nn.InstanceNorm2d(4), nn.SiLU()))
        True
        >>> can_chunk((nn.Conv2d(4, 4, 1, groups=2), nn.InstanceNorm2d(4), nn.SiLU()))
        False
    """
    if len(stage) != 3:
        return False
    conv, norm, act = stage
    return (
        type(conv) in (nn.Conv2d, nn.ConvTranspose2d)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and input_statistics_norm(norm)
        and elementwise_activation(act)
    )


def _even_split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (index < total % parts) for index in range(parts)]


def chunked_conv_norm_act(stage: Sequence[nn.Module], x: Tensor, chunks: int) -> Tensor:
    """``activation(norm(conv(x)))`` in ``chunks`` chunks of output channels, each one checkpointed.

    Only ``x`` and the parameters are kept for backward, which recomputes one chunk at a time.
    The stage must pass :func:`can_chunk`.

    Example::

        >>> stage = (nn.ConvTranspose2d(4, 6, 4, 2, 1), nn.InstanceNorm2d(6, affine=True), nn.SiLU())
        >>> x = torch.randn(2, 4, 5, 3, requires_grad=True)
        >>> lean = chunked_conv_norm_act(stage, x, chunks=4)
        >>> lean.shape, bool(torch.allclose(lean, nn.Sequential(*stage)(x), atol=1e-6))
        (torch.Size([2, 6, 10, 6]), True)
    """
    conv, norm, _ = stage
    sizes = _even_split(conv.out_channels, chunks)
    weights = conv.weight.split(sizes, dim=1 if isinstance(conv, nn.ConvTranspose2d) else 0)
    biases = conv.bias.split(sizes) if conv.bias is not None else (None,) * len(sizes)
    gammas = norm.weight.split(sizes) if norm.weight is not None else (None,) * len(sizes)
    betas = norm.bias.split(sizes) if norm.bias is not None else (None,) * len(sizes)
    pieces = [
        # the activations are deterministic: no RNG state to keep (it would cost a device sync per chunk)
        checkpoint(_stage_chunk, stage, x, *params, use_reentrant=False, preserve_rng_state=False)
        for params in zip(weights, biases, gammas, betas, strict=True)
    ]
    return torch.cat(pieces, dim=1)


def _stage_chunk(stage: Sequence[nn.Module], x: Tensor, weight: Tensor, *affine: Tensor | None) -> Tensor:
    """The stage on the output channels of ``weight``; ``affine``: their conv bias, norm weight and norm bias."""
    bias, gamma, beta = affine
    conv, norm, act = stage
    if isinstance(conv, nn.ConvTranspose2d):
        z = F.conv_transpose2d(x, weight, bias, conv.stride, conv.padding, conv.output_padding, 1, conv.dilation)
    else:
        z = F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, 1)
    momentum = norm.momentum if norm.momentum is not None else 0.0
    return act(F.instance_norm(z, None, None, gamma, beta, True, momentum, norm.eps))
