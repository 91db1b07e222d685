"""The Sapiens surface-normal head: upsample a ViT feature map 8× and predict a 3-channel normal map."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.structure import MemoryStructure


class ConvNormAct(nn.Sequential):
    """One head stage: a convolution, then InstanceNorm2d and SiLU (the unit activation checkpointing wraps)."""

    def __init__(self, conv: nn.Module, channels: int) -> None:
        super().__init__(conv, nn.InstanceNorm2d(channels), nn.SiLU())


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
        self.refine = nn.Sequential(
            *(
                ConvNormAct(nn.Conv2d(source, target, kernel_size=1), target)
                for source, target in zip(channels[len(deconv_channels) :], conv_channels, strict=False)
            )
        )
        self.dropout = nn.Dropout2d(dropout)
        self.predict = nn.Conv2d(channels[-1], 3, kernel_size=1)

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the conv stages; its output conv is an fp32 island."""
        return MemoryStructure(blocks=(*self.upsample, *self.refine), fp32_islands=(self.predict,))

    def forward(self, features: Tensor) -> Tensor:
        normals = self.predict(self.dropout(self.refine(self.upsample(features))))
        return F.normalize(normals, dim=1) if self.normalize_output else normals
