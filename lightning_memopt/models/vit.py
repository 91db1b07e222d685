"""A plain Vision Transformer that returns a feature map: the backbone of the Sapiens presets.

Patch embedding conv (kernel = stride = patch size, padding 2), a learned position table of the
pre-training grid resized at forward time to the actual token grid (or moved to one grid for good
with ``set_position_grid``), pre-norm blocks with qkv bias and stochastic depth, a final LayerNorm,
and the tokens reshaped to ``[B, C, H/p, W/p]``. There is no class token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.structure import AttentionSwitch, MemoryStructure, check_attn_impl

_LAYER_NORM_EPS = 1e-6
_INIT_STD = 0.02


def resize_position_table(table: Tensor, source_grid: Sequence[int], target_grid: Sequence[int]) -> Tensor:
    """Resize a ``[1, h·w, C]`` position table from grid ``source_grid`` to ``target_grid`` (bicubic).

    Args:
        table: the table, row-major over a ``source_grid = (h, w)`` grid of tokens.
        source_grid: ``(h, w)`` of ``table``.
        target_grid: ``(h', w')`` wanted; the table comes back unchanged when it equals ``source_grid``.

    Example::

        >>> table = torch.ones(1, 64 * 64, 8)
        >>> resized = resize_position_table(table, (64, 64), (64, 48))
        >>> resized.shape, bool(torch.allclose(resized, torch.ones(1, 64 * 48, 8)))
        (torch.Size([1, 3072, 8]), True)
    """
    source_h, source_w = source_grid
    target_h, target_w = target_grid
    if (source_h, source_w) == (target_h, target_w):
        return table
    channels = table.shape[-1]
    grid = table.reshape(1, source_h, source_w, channels).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(target_h, target_w), mode="bicubic", align_corners=False)
    return grid.flatten(2).transpose(1, 2)


class DropPath(nn.Module):
    """Stochastic depth: in training, zero a residual branch for a random ``rate`` of the samples.

    Kept samples are scaled by ``1 / (1 − rate)`` so the expectation is unchanged; in eval mode, and
    at rate 0, it is the identity.

    Example::

        >>> DropPath(0.5).eval()(torch.ones(2, 3)).tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """

    def __init__(self, rate: float = 0.0) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:
        if self.rate == 0.0 or not self.training:
            return x
        keep = 1.0 - self.rate
        sample_mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * sample_mask / keep

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    Args:
        dim: token width; divisible by ``num_heads``.
        num_heads: attention heads.
        qkv_bias: bias of the qkv projection.
        attn_impl: ``"sdpa"`` (``F.scaled_dot_product_attention``, fused kernels where available) or
            ``"math"`` (``softmax(q kᵀ · scale) v``, materialising the B × heads × N × N matrix like the
            reference code). The attribute can be changed after construction.

    Raises:
        ValueError: for an unknown ``attn_impl``.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_impl: str = "sdpa") -> None:
        super().__init__()
        check_attn_impl(attn_impl)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.attn_impl = attn_impl
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            weights = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
            out = weights @ v
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))

    def memory_structure(self) -> MemoryStructure:
        """Its attention kernel is the ``attn_impl`` attribute."""
        return MemoryStructure(attention=AttentionSwitch(self))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))`` (GELU FFN).

    Args:
        dim: token width.
        num_heads: attention heads.
        ffn_dim: hidden width of the feed-forward network.
        qkv_bias: bias of the qkv projection.
        drop_path: stochastic-depth rate of both residual branches.
        attn_impl: see :class:`Attention`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ffn_dim: int,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        attn_impl: str = "sdpa",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_impl=attn_impl)
        self.norm2 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.ffn(self.norm2(x)))


class VisionTransformer(nn.Module):
    """Plain ViT backbone mapping images ``[B, 3, H, W]`` to a feature map ``[B, C, h, w]``.

    The token grid is ``h = ⌊(H + 2·padding − p) / p⌋ + 1`` (likewise ``w``): 64 × 48 for a
    1024 × 768 input at patch 16. The position table holds ``position_grid`` (the pre-training grid,
    64 × 64) and is resized bicubically to the token grid of each input, so any input size runs;
    :meth:`set_position_grid` moves the table to another grid for good.

    Args:
        embed_dim: token width ``C``.
        depth: number of blocks, kept in the ``nn.ModuleList`` ``blocks``.
        num_heads: attention heads; must divide ``embed_dim``.
        ffn_dim: hidden width of each block's feed-forward network.
        patch_size: side ``p`` of the square patches (a larger patch means fewer tokens).
        patch_padding: zero padding of the patch-embedding conv.
        in_channels: image channels.
        position_grid: ``(h, w)`` grid of the learned position table.
        qkv_bias: bias of the qkv projections.
        drop_path_rate: stochastic-depth rate of the last block, rising linearly from 0 at the first.
        attn_impl: ``"sdpa"`` or ``"math"``, see :class:`Attention`.

    Raises:
        ValueError: for an ``embed_dim`` not divisible by ``num_heads``, a ``drop_path_rate`` outside
            [0, 1), a non-positive size, or an unknown ``attn_impl``.

    Example::

        >>> vit = VisionTransformer(embed_dim=32, depth=2, num_heads=2, ffn_dim=64, position_grid=(4, 4))
        >>> vit(torch.randn(1, 3, 64, 48)).shape
        torch.Size([1, 32, 4, 3])
    """

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        ffn_dim: int,
        patch_size: int = 16,
        patch_padding: int = 2,
        in_channels: int = 3,
        position_grid: Sequence[int] = (64, 64),
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        attn_impl: str = "sdpa",
    ) -> None:
        super().__init__()
        sizes = {
            "embed_dim": embed_dim,
            "depth": depth,
            "num_heads": num_heads,
            "ffn_dim": ffn_dim,
            "patch_size": patch_size,
            "in_channels": in_channels,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive integer")
        if embed_dim % num_heads:
            raise ValueError(f"`embed_dim`={embed_dim!r} must be divisible by `num_heads`={num_heads!r}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"`drop_path_rate`={drop_path_rate!r} must be in [0, 1)")
        if len(position_grid) != 2 or min(position_grid) < 1:
            raise ValueError(f"`position_grid`={position_grid!r} must be two positive integers (h, w)")
        check_attn_impl(attn_impl)
        self.embed_dim = embed_dim
        self.depth = depth
        self.patch_size = patch_size
        self.patch_padding = patch_padding
        self.position_grid = (int(position_grid[0]), int(position_grid[1]))
        self.patch_embed = nn.Conv2d(
            in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, padding=patch_padding
        )
        self.pos_embed = nn.Parameter(torch.empty(1, self.position_grid[0] * self.position_grid[1], embed_dim))
        # Python arithmetic, not torch.linspace: the rates must be plain floats even on the meta device.
        rates = [drop_path_rate * index / max(depth - 1, 1) for index in range(depth)]
        self.blocks = nn.ModuleList(
            ViTBlock(embed_dim, num_heads, ffn_dim, qkv_bias=qkv_bias, drop_path=rate, attn_impl=attn_impl)
            for rate in rates
        )
        self.norm = nn.LayerNorm(embed_dim, eps=_LAYER_NORM_EPS)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=_INIT_STD)
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=_INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the transformer blocks (checkpoint, offload and FSDP units)."""
        return MemoryStructure(blocks=tuple(self.blocks))

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """The ``(h, w)`` token grid of an ``height`` × ``width`` input.

        Example::

            >>> vit = VisionTransformer(embed_dim=8, depth=1, num_heads=1, ffn_dim=8, patch_size=32)
            >>> vit.token_grid(1024, 768)
            (32, 24)
        """
        stride, padding = self.patch_size, self.patch_padding
        return (height + 2 * padding - stride) // stride + 1, (width + 2 * padding - stride) // stride + 1

    def set_position_grid(self, grid: Sequence[int]) -> None:
        """Hold the position table on ``grid`` from now on: the table is resized to it once (bicubic).

        A model whose inputs all share one token grid (the fine-tuned Sapiens checkpoints: 64 × 48
        at 1024 × 768) then adds its table with no resize at forward time. ``pos_embed`` becomes a new
        parameter on the same device, of the same dtype and ``requires_grad``: call this before an
        optimizer or a sharding wrapper takes the parameters.

        Args:
            grid: the new ``(h, w)``; nothing changes when it is the current grid.

        Raises:
            ValueError: for a grid that is not two positive integers.

        Example::

            >>> vit = VisionTransformer(embed_dim=8, depth=1, num_heads=1, ffn_dim=8, position_grid=(4, 4))
            >>> vit.set_position_grid(vit.token_grid(64, 48))
            >>> vit.position_grid, tuple(vit.pos_embed.shape)
            ((4, 3), (1, 12, 8))
        """
        if len(grid) != 2 or min(grid) < 1:
            raise ValueError(f"`grid`={grid!r} must be two positive integers (h, w)")
        target = (int(grid[0]), int(grid[1]))
        if target == self.position_grid:
            return
        with torch.no_grad():
            table = resize_position_table(self.pos_embed, self.position_grid, target)
        self.pos_embed = nn.Parameter(table.contiguous(), requires_grad=self.pos_embed.requires_grad)
        self.position_grid = target

    def layer_id(self, name: str) -> int:
        """Depth of parameter ``name`` (relative to this module) for layer-wise learning-rate decay.

        0 for the patch embedding and the position table, ``i + 1`` for block ``i``, and
        ``depth + 1`` for what follows the blocks (the final norm).

        Example::

            >>> vit = VisionTransformer(embed_dim=8, depth=2, num_heads=1, ffn_dim=8)
            >>> [vit.layer_id(n) for n in ("pos_embed", "patch_embed.weight", "blocks.1.norm1.bias", "norm.weight")]
            [0, 0, 2, 3]
        """
        if name == "pos_embed" or name.startswith("patch_embed."):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.depth + 1

    def forward(self, images: Tensor) -> Tensor:
        features = self.patch_embed(images)
        batch, channels, height, width = features.shape
        tokens = features.flatten(2).transpose(1, 2)
        tokens = tokens + resize_position_table(self.pos_embed, self.position_grid, (height, width))
        for block in self.blocks:
            tokens = block(tokens)
        tokens = self.norm(tokens)
        return tokens.transpose(1, 2).reshape(batch, channels, height, width)
