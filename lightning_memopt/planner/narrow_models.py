"""Narrow models: a few blocks of common architectures on tiny tensors, where the host sets a step's time.

The host's costs of checkpointing are fitted on :data:`NARROW_MODELS` (:mod:`lightning_memopt.planner.host`) and
checked on :data:`HELD_OUT_MODELS`, which the fit never saw.

Example::

    >>> model, x = narrow_model("mixer", blocks=2)
    >>> len(model), tuple(model(x).shape)
    (2, (2, 8, 16))
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

NARROW_MODELS = ("cnn", "transformer")  # the host's costs are fitted on these
HELD_OUT_MODELS = ("iresnet", "mixer")  # and checked on these


class Bottleneck(nn.Module):
    """1×1, 3×3 and 1×1 convolutions with batch norm and ReLU, and a residual: a ResNet block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(width, width, k, padding=k // 2, bias=False) for k in (1, 3, 1))
        self.norms = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
            y = norm(conv(y))
            y = F.relu(y + x if index == 2 else y)
        return y


class EncoderBlock(nn.Module):
    """Pre-norm attention and MLP with residuals: a ViT block."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PreActBasicBlock(nn.Module):
    """Batch norm, 3×3 convolution, batch norm, PReLU, 3×3 convolution, batch norm, and a residual: an IResNet
    block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(3))
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, bias=False) for _ in range(2))
        self.prelu = nn.PReLU(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.prelu(self.norms[1](self.convs[0](self.norms[0](x))))
        return x + self.norms[2](self.convs[1](y))


class MixerBlock(nn.Module):
    """Token mixing across the sequence (transposed), then channel mixing, each pre-norm with a residual: an
    MLP-Mixer block."""

    def __init__(self, tokens: int = 8, width: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.token1, self.token2 = nn.Linear(tokens, 2 * tokens), nn.Linear(2 * tokens, tokens)
        self.channel1, self.channel2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token2(F.gelu(self.token1(self.norm1(x).transpose(1, 2))))
        x = x + mixed.transpose(1, 2)
        return x + self.channel2(F.gelu(self.channel1(self.norm2(x))))


_BUILDERS = {  # name: (block, default blocks, input shape)
    "cnn": (Bottleneck, 16, (2, 8, 8, 8)),
    "transformer": (EncoderBlock, 12, (2, 8, 16)),
    "iresnet": (PreActBasicBlock, 16, (2, 8, 8, 8)),
    "mixer": (MixerBlock, 12, (2, 8, 16)),
}


def narrow_model(name: str, blocks: int | None = None) -> tuple[nn.Sequential, torch.Tensor]:
    """A narrow model of ``name`` (``"cnn"``: 16 bottlenecks; ``"transformer"``: 12 encoder blocks; ``"iresnet"``:
    16 IResNet blocks; ``"mixer"``: 12 Mixer blocks; or ``blocks`` of them) and its input.

    Raises:
        ValueError: an unknown ``name``, listing :data:`NARROW_MODELS` and :data:`HELD_OUT_MODELS`.
    """
    if name not in _BUILDERS:
        choices = ", ".join((*NARROW_MODELS, *HELD_OUT_MODELS))
        raise ValueError(f"Unknown `name`={name!r}; valid choices: {choices}")
    block, default, shape = _BUILDERS[name]
    return nn.Sequential(*(block() for _ in range(blocks or default))), torch.randn(*shape)
