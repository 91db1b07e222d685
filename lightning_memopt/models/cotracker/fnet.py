"""CoTracker's feature network ("fnet"): a BasicEncoder mapping each frame to stride-4 features."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ResidualBlock(nn.Module):
    """conv3×3 → InstanceNorm → ReLU → conv3×3 → InstanceNorm → ReLU, plus the shortcut, then ReLU.

    The first convolution carries the stride; a strided or widening block has a conv1×1 +
    InstanceNorm shortcut.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1)
        self.norm1 = nn.InstanceNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = nn.InstanceNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride), nn.InstanceNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(self.shortcut(x) + y)


class BasicEncoder(nn.Module):
    """Per-frame features at ``1/stride`` resolution.

    A 7×7 stride-2 convolution, four stages of two residual blocks (the first block of stages 2–4
    halves the resolution), every stage output resized bilinearly to ``1/stride`` and concatenated,
    then conv3×3 → ``hidden_dim`` (InstanceNorm, ReLU) and conv1×1 → ``output_dim``.

    Args:
        widths: channels of the four stages; the stem has ``widths[0]``.
        hidden_dim: channels of the fusing conv3×3.
        output_dim: channels of the output (CoTracker's latent dimension).
        stride: output stride.

    Raises:
        ValueError: ``widths`` does not have four entries, or ``stride`` < 1.

    Example::

        >>> fnet = BasicEncoder(widths=(8, 8, 16, 16), hidden_dim=16, output_dim=8)
        >>> fnet(torch.randn(2, 3, 32, 48)).shape
        torch.Size([2, 8, 8, 12])
    """

    def __init__(
        self,
        widths: Sequence[int] = (64, 96, 128, 128),
        hidden_dim: int = 256,
        output_dim: int = 128,
        stride: int = 4,
    ) -> None:
        super().__init__()
        if len(widths) != 4:
            raise ValueError(f"`widths` needs one entry per stage (4), got {list(widths)!r}")
        if stride < 1:
            raise ValueError(f"`stride`={stride!r} must be at least 1")
        self.stride = stride
        self.output_dim = output_dim
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3), nn.InstanceNorm2d(widths[0]), nn.ReLU()
        )
        stages = []
        in_channels = widths[0]
        for index, width in enumerate(widths):
            stride_of_stage = 1 if index == 0 else 2
            stages.append(
                nn.Sequential(ResidualBlock(in_channels, width, stride_of_stage), ResidualBlock(width, width))
            )
            in_channels = width
        self.stages = nn.ModuleList(stages)
        self.fuse = nn.Sequential(
            nn.Conv2d(sum(widths), hidden_dim, kernel_size=3, padding=1), nn.InstanceNorm2d(hidden_dim), nn.ReLU()
        )
        self.project = nn.Conv2d(hidden_dim, output_dim, kernel_size=1)

    def forward(self, images: Tensor) -> Tensor:
        """[M, 3, H, W] → [M, output_dim, H // stride, W // stride]."""
        size = (images.shape[-2] // self.stride, images.shape[-1] // self.stride)
        x = self.stem(images)
        outputs = []
        for stage in self.stages:
            x = stage(x)
            outputs.append(F.interpolate(x, size=size, mode="bilinear", align_corners=True))
        return self.project(self.fuse(torch.cat(outputs, dim=1)))
