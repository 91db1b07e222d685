"""IResNet, the backbone of ArcFace and TopoFR (presets r18 … r200 and a tiny test variant).

Layer shapes follow the published architecture: a 3×3 stem, four stages of improved basic blocks
(BN → conv → BN → PReLU → strided conv → BN, plus identity), then BN → flatten → dropout →
Linear(C·(s/16)² → embedding) → BatchNorm1d.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_memopt.models.registry import register_model
from lightning_memopt.models.structure import MemoryStructure

_BN_EPS = 1e-5


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """Improved basic block: BN → conv3×3 → BN → PReLU → conv3×3 (strided) → BN, plus the shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=_BN_EPS)
        self.conv1 = _conv3x3(in_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=_BN_EPS)
        self.prelu = nn.PReLU(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels, stride)
        self.bn3 = nn.BatchNorm2d(out_channels, eps=_BN_EPS)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels, eps=_BN_EPS),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Module):
    """IResNet face-embedding network.

    Args:
        layers: blocks per stage, e.g. ``(2, 2, 2, 2)`` for r18.
        widths: channels per stage; the published presets use ``(64, 128, 256, 512)``.
        embedding_size: size of the output embedding (512 in the presets).
        input_size: side of the square input; must be divisible by 16 (112 in the presets).
        dropout: dropout probability before the embedding Linear.
        fp32_head: run the embedding head (Linear + BatchNorm1d) with autocast disabled, in the
            dtype of its own parameters (fp32 unless the whole model was cast to half), so under
            mixed precision only the convolutional trunk runs in half precision, as in the
            reference training code.
        freeze_embedding_bn_weight: keep the final BatchNorm1d weight fixed at 1 (ArcFace); set
            ``False`` to train it (TopoFR).

    Raises:
        ValueError: for an ``input_size`` not divisible by 16, or ``layers``/``widths`` not of length 4.

    Example::

        >>> net = IResNet(layers=(1, 1, 1, 1), widths=(8, 16, 32, 64), embedding_size=32, input_size=32)
        >>> net(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 32])
    """

    def __init__(
        self,
        layers: Sequence[int],
        widths: Sequence[int] = (64, 128, 256, 512),
        embedding_size: int = 512,
        input_size: int = 112,
        dropout: float = 0.0,
        fp32_head: bool = True,
        freeze_embedding_bn_weight: bool = True,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or len(widths) != 4:
            raise ValueError(
                f"`layers` and `widths` need one entry per stage (4), got {list(layers)!r} and {list(widths)!r}"
            )
        if not isinstance(input_size, int) or input_size % 16 or input_size < 16:
            raise ValueError(f"`input_size`={input_size!r} must be a positive multiple of 16 (four stride-2 stages)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout`={dropout!r} must be in [0, 1)")
        self.fp32_head = fp32_head
        self.embedding_size = embedding_size
        self.conv1 = _conv3x3(3, widths[0])
        self.bn1 = nn.BatchNorm2d(widths[0], eps=_BN_EPS)
        self.prelu = nn.PReLU(widths[0])
        stages = []
        in_channels = widths[0]
        for num_blocks, width in zip(layers, widths, strict=True):
            blocks = [IBasicBlock(in_channels, width, stride=2)]
            blocks += [IBasicBlock(width, width) for _ in range(num_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.bn2 = nn.BatchNorm2d(widths[-1], eps=_BN_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(widths[-1] * (input_size // 16) ** 2, embedding_size)
        self.features = nn.BatchNorm1d(embedding_size, eps=_BN_EPS)
        self._init_weights()
        if freeze_embedding_bn_weight:
            self.features.weight.requires_grad_(False)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.1)
            elif isinstance(module, nn.BatchNorm2d | nn.BatchNorm1d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the residual blocks of the four stages."""
        stages = (self.layer1, self.layer2, self.layer3, self.layer4)
        return MemoryStructure(blocks=tuple(block for stage in stages for block in stage))

    def forward_trunk(self, x: Tensor) -> Tensor:
        """The convolutional trunk: image → flattened final feature map (before dropout)."""
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.bn2(x), 1)

    def forward_head(self, x: Tensor) -> Tensor:
        """Dropout → Linear → BatchNorm1d; with ``fp32_head``, autocast off and in the head's dtype."""
        if not self.fp32_head:
            return self.features(self.fc(self.dropout(x)))
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.features(self.fc(self.dropout(x.to(self.fc.weight.dtype))))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_trunk(x))


_IRESNET_LAYERS = {
    "r18": (2, 2, 2, 2),
    "r34": (3, 4, 6, 3),
    "r50": (3, 4, 14, 3),
    "r100": (3, 13, 30, 3),
    "r200": (6, 26, 60, 6),
}


def _register_iresnet_preset(name: str, layers: tuple[int, int, int, int]) -> None:
    def factory(**overrides: object) -> IResNet:
        return IResNet(layers=layers, **overrides)  # type: ignore[arg-type]

    factory.__doc__ = f"IResNet preset {name}: blocks per stage {layers}, 3×112×112 → 512."
    register_model(name)(factory)


for _name, _layers in _IRESNET_LAYERS.items():
    _register_iresnet_preset(_name, _layers)


@register_model("iresnet_tiny")
def iresnet_tiny(**overrides: object) -> IResNet:
    """A one-block-per-stage, narrow IResNet on 32×32 inputs: trains a step on CPU in milliseconds."""
    options: dict = {"layers": (1, 1, 1, 1), "widths": (8, 16, 32, 64), "embedding_size": 32, "input_size": 32}
    options.update(overrides)
    return IResNet(**options)
