"""Memory-lean recomputation of conv → InstanceNorm2d → activation stages: channel chunks (here), spatial tiles.

Checkpointed whole, a full-resolution stage rematerialises in backward its conv output, its
normalised output and the activation's gradient, each as large as the stage's output. Two leaner
recomputations keep only a fraction of that live at once:

* :func:`chunked_conv_norm_act` computes one stage in chunks of its output channels, each chunk
  checkpointed on its own (instance norm's statistics are per channel, so chunks are independent):
  backward rematerialises one chunk at a time.
* :func:`~lightning_memopt.models.tiled_chain.tiled_conv_norm_act_chain` runs a chain of 1×1 stages
  over tiles of rows, gathering each instance norm's whole-map statistics in passes over the tiles.

How finely each is cut follows from memory need (:class:`PieceRule`): the fewest pieces whose
internals stay within a share of what the block's backward holds anyway, or within what another
block of the model holds anyway (the step's peak is there: cutting finer saves nothing). One piece
is the plain recomputation, so the modules fall back to ``torch.utils.checkpoint`` then.

Both use only public ``torch`` ops; hooks of the stages' submodules do not fire on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
# chunk-sized tensors a chunk's recomputation holds at once in backward: the conv output (kept by the
# norm), the normalised output (kept by the activation) and one gradient of that size
CHUNK_TENSORS = 3


@dataclass(frozen=True)
class PieceRule:
    """How finely a lean recomputation is cut: into the fewest pieces (channel chunks, row tiles) memory needs.

    Cut into ``n`` pieces, a block's backward holds ``held / n`` bytes again at once on top of its
    ``floor``, the bytes it holds however it is cut (its input, its output gradient, its input
    gradient); ``held`` is what one piece, the whole recomputation, would hold. The rule takes the
    fewest ``n`` with ``held / n ≤ max(fraction, headroom) × floor``: each further piece costs
    kernels and host work, and saves nothing once the step's peak is set elsewhere.

    Args:
        fraction: the most one piece may hold, as a share of the floor: the block's backward peaks at
            most this much above what no recomputation avoids (1/8 by default).
        headroom: what another block's backward holds anyway beyond this block's floor, as a multiple
            of that floor (0: unknown). A model that knows its blocks sets it
            (:class:`~lightning_memopt.models.normal_head.NormalHead` does): up to there the step's peak
            does not move.

    Raises:
        ValueError: ``fraction`` outside (0, 1], or a negative ``headroom``, each named with its value.

    Example::

        >>> PieceRule().pieces(held=4.0, floor=3.0)             # 4 / 11 ≤ 3 / 8
        11
        >>> PieceRule(headroom=1.0).pieces(held=3.0, floor=1.5)  # what another block holds anyway
        2
        >>> PieceRule().pieces(held=4.0, floor=3.0, most=6)     # never more than the rows or channels
        6
    """

    fraction: float = 0.125
    headroom: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise ValueError(f"`fraction`={self.fraction!r} must be a number in (0, 1] (a share of the block's floor)")
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) or not self.headroom >= 0:
            raise ValueError(f"`headroom`={self.headroom!r} must be a number >= 0 (a multiple of the block's floor)")

    def pieces(self, held: float, floor: float, most: int | None = None) -> int:
        """The fewest pieces (at least 1, at most ``most``) whose share of ``held`` fits the allowance."""
        allowance = max(self.fraction, self.headroom) * floor
        needed = math.ceil(held / allowance) if allowance > 0 else 1
        return max(1, min(needed, most) if most is not None else needed)


def check_pieces(name: str, value: object, automatic: bool = False) -> None:
    """Raise unless ``value`` is a valid count of pieces for the argument ``name`` (None too where ``automatic``).

    Example::

        >>> check_pieces("tiles", 0)
        Traceback (most recent call last):
        ...
        ValueError: `tiles`=0 must be a positive integer
    """
    if value is None and automatic:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        choices = "a positive integer, or None (the fewest that memory needs)" if automatic else "a positive integer"
        raise ValueError(f"`{name}`={value!r} must be {choices}")


def conv_output_shape(conv: nn.Module, shape: Sequence[int]) -> tuple[int, ...]:
    """The output shape of the Conv2d or ConvTranspose2d ``conv`` for an input of ``shape`` (as its forward gives).

    Example::

        >>> conv_output_shape(nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1), (2, 8, 5, 3))
        (2, 6, 10, 6)
        >>> conv_output_shape(nn.Conv2d(8, 6, 3, stride=2), (2, 8, 9, 9))
        (2, 6, 4, 4)
    """
    batch, _, *size = shape
    geometry = zip(size, conv.kernel_size, conv.stride, conv.dilation, strict=True)
    if isinstance(conv, nn.ConvTranspose2d):
        pads = zip(conv.padding, conv.output_padding, strict=True)
        out = [(n - 1) * s - 2 * p + d * (k - 1) + o + 1 for (n, k, s, d), (p, o) in zip(geometry, pads, strict=True)]
    elif conv.padding == "same":
        out = list(size)
    else:
        padding = (0, 0) if conv.padding == "valid" else conv.padding
        out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for (n, k, s, d), p in zip(geometry, padding, strict=True)]
    return (batch, conv.out_channels, *out)


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


def chunk_memory(stage: Sequence[nn.Module], shape: Sequence[int], itemsize: int = 4) -> tuple[int, int]:
    """``(held, floor)``: what recomputing ``stage`` whole on an input of ``shape`` holds at once in backward, and
    what its backward holds however it is cut (its input, its output gradient, its input gradient), in bytes.

    Example::

        >>> chunk_memory((nn.ConvTranspose2d(8, 8, 4, 2, 1), nn.InstanceNorm2d(8), nn.SiLU()), (1, 8, 4, 4))
        (6144, 3072)
    """
    inputs = math.prod(shape) * itemsize
    outputs = math.prod(conv_output_shape(stage[0], shape)) * itemsize
    return CHUNK_TENSORS * outputs, 2 * inputs + outputs


def _even_split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (index < total % parts) for index in range(parts)]


def chunked_conv_norm_act(stage: Sequence[nn.Module], x: Tensor, chunks: int) -> Tensor:
    """``activation(norm(conv(x)))`` in ``chunks`` chunks of output channels, each one checkpointed.

    Only ``x`` and the parameters are kept for backward, which recomputes one chunk at a time.
    The stage must pass :func:`can_chunk`.

    Raises:
        ValueError: ``chunks`` is not a positive integer.

    Example::

        >>> stage = (nn.ConvTranspose2d(4, 6, 4, 2, 1), nn.InstanceNorm2d(6, affine=True), nn.SiLU())
        >>> x = torch.randn(2, 4, 5, 3, requires_grad=True)
        >>> lean = chunked_conv_norm_act(stage, x, chunks=4)
        >>> lean.shape, bool(torch.allclose(lean, nn.Sequential(*stage)(x), atol=1e-6))
        (torch.Size([2, 6, 10, 6]), True)
    """
    check_pieces("chunks", chunks)
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
