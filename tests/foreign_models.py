"""Models written the way other projects write them: they declare nothing to lightning_memopt.

Used by the tests of block discovery, checkpointing, FSDP units and planning on models that are
not ours. Each is small enough to train a step on the CPU in milliseconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, tokens, dim))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch embedding, a ``ModuleList`` of encoder layers, a classifier: ``images [B, 3, 32, 32] → [B, classes]``."""

    def __init__(self, depth: int = 4, dim: int = 32, heads: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, kernel_size=8, stride=8)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.classifier(self.norm(x).mean(1))


class ConvBnAct(nn.Sequential):
    def __init__(self, source: int, target: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(source, target, 3, stride, 1, bias=False), nn.BatchNorm2d(target), nn.ReLU())


class ResidualBlock(nn.Module):
    def __init__(self, source: int, target: int, stride: int = 1) -> None:
        super().__init__()
        self.layers = nn.Sequential(ConvBnAct(source, target, stride), ConvBnAct(target, target))
        self.shortcut = nn.Identity() if stride == 1 and source == target else nn.Conv2d(source, target, 1, stride)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x) + self.shortcut(x)


class Stage(nn.Module):
    def __init__(self, source: int, target: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            ResidualBlock(source, target, 2), *(ResidualBlock(target, target) for _ in range(blocks - 1))
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


class StagedCNN(nn.Module):
    """A ResNet-like CNN: a stem, ``Stage`` modules each holding a ``Sequential`` of residual blocks, a head."""

    def __init__(self, blocks: tuple[int, ...] = (2, 3, 2), width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBnAct(3, width)
        widths = [width * 2**index for index in range(len(blocks))]
        self.stages = nn.ModuleList(
            Stage(source, target, count)
            for source, target, count in zip([width, *widths], widths, blocks, strict=False)
        )
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


class TwoTower(nn.Module):
    """Nested containers: two towers in a ``ModuleDict``, each a ``Sequential`` of ``ModuleList``-held layers."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.towers = nn.ModuleDict(
            {
                "image": nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, dim), Tower(dim, 3)),
                "text": nn.Sequential(nn.Linear(dim, dim), Tower(dim, 2)),
            }
        )

    def forward(self, images: Tensor, text: Tensor) -> Tensor:
        return F.cosine_similarity(self.towers["image"](images), self.towers["text"](text)).mean()


class Tower(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), MlpLayer(dim)) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class MlpLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Unrepeated(nn.Module):
    """Nothing repeats: an encoder, a bottleneck and a decoder of different classes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU())
        self.bottleneck = nn.Linear(8, 8)
        self.decoder = nn.ConvTranspose2d(8, 3, 4, 2, 1)

    def forward(self, images: Tensor) -> Tensor:
        x = self.encoder(images)
        x = self.bottleneck(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.decoder(x)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of ``model(images)`` against ``labels``: the ``loss_fn`` of profile_step and plan()."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def image_batch(size: int = 8, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``size`` random 3 × 32 × 32 images and labels of 10 classes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)
