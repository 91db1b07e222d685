"""The Sapiens surface-normal head: upsample a ViT feature map 8× and predict a 3-channel normal map."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_memopt.checkpointing.lean import LeanRecompute
from lightning_memopt.models.lean_recompute import can_chunk, chunked_conv_norm_act
from lightning_memopt.models.structure import MemoryStructure
from lightning_memopt.models.tiled_chain import can_tile, tiled_conv_norm_act_chain


class ConvNormAct(nn.Sequential):
    """One head stage: a convolution, then InstanceNorm2d and SiLU (the unit activation checkpointing wraps).

    Fully checkpointed, it recomputes in :attr:`chunks` chunks of output channels, one at a time
    (:meth:`checkpointed_forward`).

    Example::

        >>> import torch
        >>> stage = ConvNormAct(nn.Conv2d(4, 8, 1), 8)
        >>> x = torch.randn(2, 4, 6, 5, requires_grad=True)
        >>> bool(torch.allclose(stage.checkpointed_forward(x), stage(x), atol=1e-6))
        True
    """

    chunks: int = 8  # output-channel chunks of the lean recomputation

    def __init__(self, conv: nn.Module, channels: int) -> None:
        super().__init__(conv, nn.InstanceNorm2d(channels), nn.SiLU())

    def checkpointed_forward(self, x: Tensor) -> Tensor:
        """The forward, keeping only ``x`` for backward, which recomputes one chunk of channels at a time.

        A stage :func:`~lightning_memopt.models.lean_recompute.can_chunk` refuses (grouped conv,
        running statistics, …) is checkpointed whole instead.
        """
        if x.dim() == 4 and can_chunk(self):
            return chunked_conv_norm_act(self, x, self.chunks)
        return checkpoint(nn.Sequential.forward, self, x, use_reentrant=False)

    def lean_recompute(self) -> LeanRecompute:
        """For the planner: one chunk's internals held again at a time, the forward recomputed once."""
        return LeanRecompute(held_fraction=1 / self.chunks if can_chunk(self) else 1.0, forwards=1.0)


class ConvNormActChain(nn.Sequential):
    """:class:`ConvNormAct` stages in a row; fully checkpointed, the 1×1 ones recompute over tiles of rows.

    Its :meth:`checkpointed_forward` runs the whole chain over :attr:`tiles` tiles of rows, so no
    full-resolution tensor of the chain exists but its input and output (state-dict keys are those
    of an ``nn.Sequential``).

    Example::

        >>> import torch
        >>> chain = ConvNormActChain(ConvNormAct(nn.Conv2d(4, 8, 1), 8), ConvNormAct(nn.Conv2d(8, 8, 1), 8))
        >>> x = torch.randn(2, 4, 6, 5, requires_grad=True)
        >>> bool(torch.allclose(chain.checkpointed_forward(x), chain(x), atol=1e-5))
        True
    """

    tiles: int = 32  # tiles of rows of the lean recomputation (never more than the rows)

    def checkpointed_forward(self, x: Tensor) -> Tensor:
        """The forward, keeping only ``x`` for backward, which recomputes tile by tile.

        See :func:`~lightning_memopt.models.tiled_chain.tiled_conv_norm_act_chain`. A chain with
        a stage that is no 1×1, stride-1, unpadded conv (or that
        :func:`~lightning_memopt.models.tiled_chain.can_tile` refuses otherwise) is checkpointed whole.
        """
        if x.dim() == 4 and can_tile(list(self)):
            return tiled_conv_norm_act_chain(list(self), x, self.tiles)
        return checkpoint(nn.Sequential.forward, self, x, use_reentrant=False)

    def lean_recompute(self) -> LeanRecompute:
        """For the planner: one tile held again at a time. Its backward recomputes the chain once, then for each
        stage k's statistics stages 1…k again and back-propagates them: (K + 1) / 2 more forwards and as many more
        backwards (each two forwards), 1 + 3(K + 1) / 2 forwards of the chain in all."""
        if not can_tile(list(self)):
            return LeanRecompute(held_fraction=1.0, forwards=1.0)
        return LeanRecompute(held_fraction=1 / self.tiles, forwards=1.0 + 1.5 * (len(self) + 1))


class NormalHead(nn.Module):
    """Feature map ``[B, C, h, w]`` → surface normals ``[B, 3, 2ᵏh, 2ᵏw]``, raw (not unit length) by default.

    ``k`` transposed convs (kernel 4, stride 2, padding 1, no bias; each doubles the size) then
    1×1 convs, every one followed by InstanceNorm2d and SiLU (one :class:`ConvNormAct` stage each),
    then, as in the official head, ``Dropout2d`` (training only) and a final 1×1 conv to 3 channels.
    The output is raw like the official head's: callers normalise it to unit length after resizing
    it (the loss, the metrics, inference). With the published three deconv stages, a 64 × 48 feature
    map becomes a 512 × 384 normal map.

    Args:
        in_channels: channels ``C`` of the feature map.
        deconv_channels: output channels of each transposed conv (768, 768, 768 in the presets).
        conv_channels: output channels of each 1×1 conv (768, 768, 768 in the presets).
        dropout: rate of the ``Dropout2d`` before the final conv (0.1 in the reference; 0 disables it).
        normalize_output: normalise the output to unit length over the channels (this project's
            earlier behaviour) instead of returning it raw.

    Raises:
        ValueError: for a non-positive channel count or a ``dropout`` outside [0, 1).

    Example::

        >>> import torch
        >>> head = NormalHead(16, deconv_channels=(8, 8, 8), conv_channels=(8,)).eval()
        >>> head(torch.randn(2, 16, 4, 3)).shape
        torch.Size([2, 3, 32, 24])
        >>> unit = NormalHead(16, deconv_channels=(8, 8, 8), conv_channels=(8,), normalize_output=True)
        >>> bool(torch.allclose(unit(torch.randn(2, 16, 4, 3)).norm(dim=1), torch.ones(2, 32, 24)))
        True
    """

    def __init__(
        self,
        in_channels: int,
        deconv_channels: Sequence[int] = (768, 768, 768),
        conv_channels: Sequence[int] = (768, 768, 768),
        dropout: float = 0.1,
        normalize_output: bool = False,
    ) -> None:
        super().__init__()
        channels = [in_channels, *deconv_channels, *conv_channels]
        if min(channels) < 1:
            raise ValueError(
                f"channel counts must be positive, got `in_channels`={in_channels!r}, "
                f"`deconv_channels`={list(deconv_channels)!r}, `conv_channels`={list(conv_channels)!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout`={dropout!r} must be in [0, 1)")
        self.upscale = 2 ** len(deconv_channels)
        self.normalize_output = normalize_output
        self.upsample = nn.Sequential(
            *(
                ConvNormAct(nn.ConvTranspose2d(source, target, kernel_size=4, stride=2, padding=1, bias=False), target)
                for source, target in zip(channels, deconv_channels, strict=False)
            )
        )
        self.refine = ConvNormActChain(
            *(
                ConvNormAct(nn.Conv2d(source, target, kernel_size=1), target)
                for source, target in zip(channels[len(deconv_channels) :], conv_channels, strict=False)
            )
        )
        self.dropout = nn.Dropout2d(dropout)
        self.predict = nn.Conv2d(channels[-1], 3, kernel_size=1)

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the deconv stages and the 1×1 chain as one; its output conv is an fp32 island."""
        chain = (self.refine,) if len(self.refine) else ()
        return MemoryStructure(blocks=(*self.upsample, *chain), fp32_islands=(self.predict,))

    def forward(self, features: Tensor) -> Tensor:
        normals = self.predict(self.dropout(self.refine(self.upsample(features))))
        return F.normalize(normals, dim=1) if self.normalize_output else normals
