"""CoTracker's update transformer: attention over time per track and over space via virtual tracks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.models.structure import AttentionSwitch, MemoryStructure, check_attn_impl


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_mask: Tensor | None,
    attn_impl: str = "sdpa",
    query_mask: Tensor | None = None,
) -> Tensor:
    """Scaled dot-product attention, through PyTorch's fused kernel or materialised ("math").

    A query masked out by ``query_mask``, or whose keys are all masked by ``key_mask``, attends
    uniformly (its output is the mean of the values it may attend to, of all of them when none is
    allowed), as in the official CoTracker, whose huge negative bias makes all such scores equal.

    Args:
        query: [M, heads, L, d]; key, value: [M, heads, K, d].
        key_mask: [M, K] bool, True where a key may be attended to, or None for all.
        attn_impl: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"math"``
            (``softmax(q·kᵀ·scale + mask) @ v``).
        query_mask: [M, L] bool, False where a query attends uniformly, or None.

    Example::

        >>> q, k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
        >>> mask = torch.tensor([[True, False, True, True, False], [False] * 5])
        >>> torch.allclose(attention(q, k, v, mask, "sdpa"), attention(q, k, v, mask, "math"), atol=1e-6)
        True
        >>> torch.allclose(attention(q, k, v, mask)[1], v[1].mean(dim=-2, keepdim=True).expand(1, 3, 4), atol=1e-6)
        True
    """
    uniform = None if query_mask is None else ~query_mask[:, None, :, None]  # M 1 L 1
    mask = None
    if key_mask is not None:
        any_key = key_mask.any(dim=-1, keepdim=True)
        mask = (key_mask | ~any_key)[:, None, None, :]
        uniform = ~any_key[:, :, None, None] if uniform is None else uniform | ~any_key[:, :, None, None]
    if uniform is not None:
        query = query.masked_fill(uniform, 0.0)  # every score 0: the plain mean of the values
    if attn_impl == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    scores = query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ value


class Attention(nn.Module):
    """Multi-head attention with separate query and key/value projections (self or cross)."""

    def __init__(self, dim: int, num_heads: int, attn_impl: str = "sdpa") -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"`hidden_dim`={dim!r} must be divisible by `num_heads`={num_heads!r}")
        self.num_heads = num_heads
        self.attn_impl = check_attn_impl(attn_impl)
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.to_out = nn.Linear(dim, dim)

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # M L (h d) -> M h L d

    def forward(
        self, x: Tensor, context: Tensor, key_mask: Tensor | None = None, query_mask: Tensor | None = None
    ) -> Tensor:
        key, value = self.to_kv(context).chunk(2, dim=-1)
        query, key, value = self._split_heads(self.to_q(x)), self._split_heads(key), self._split_heads(value)
        out = attention(query, key, value, key_mask, self.attn_impl, query_mask)
        return self.to_out(out.transpose(1, 2).flatten(-2))

    def memory_structure(self) -> MemoryStructure:
        """Its attention kernel is the ``attn_impl`` attribute."""
        return MemoryStructure(attention=AttentionSwitch(self))


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x), context)``, then ``x + mlp(norm(x))``.

    Without ``cross`` the block attends to ``x`` itself; with it, to a context (normalised by its
    own affine LayerNorm).

    Args:
        dim: token width.
        num_heads: attention heads.
        mlp_ratio: hidden width of the MLP over ``dim``.
        cross: attend to a separate context.
        attn_impl: see :func:`attention`.

    Example::

        >>> block = AttentionBlock(16, num_heads=2, cross=True)
        >>> block(torch.randn(3, 4, 16), torch.randn(3, 7, 16)).shape
        torch.Size([3, 4, 16])
    """

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float = 4.0, cross: bool = False, attn_impl: str = "sdpa"
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm_context = nn.LayerNorm(dim) if cross else None
        self.attn = Attention(dim, num_heads, attn_impl)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        key_mask: Tensor | None = None,
        query_mask: Tensor | None = None,
    ) -> Tensor:
        normed = self.norm1(x)
        context = normed if self.norm_context is None or context is None else self.norm_context(context)
        x = x + self.attn(normed, context, key_mask, query_mask)
        return x + self.mlp(self.norm2(x))


class UpdateFormer(nn.Module):
    """Alternating time and space attention over track tokens, with learned virtual tracks.

    Tokens are ``[B, N, S, input_dim]`` (N tracks, S frames). Each time block attends over the S
    frames of every track (real and virtual); after every ``time_depth // space_depth``-th time
    block a space block runs per frame: the virtual tracks attend to the points (virtual←point),
    then to each other, then the points attend to the virtual tracks (point←virtual). With a
    ``point_mask``, the points not marked in it are the official CoTracker2's not-yet-queried points:
    they are masked out of the virtual←point keys, and attend uniformly in point←virtual (see
    :func:`attention`). A linear head maps the point tokens to ``output_dim`` updates.

    Args:
        input_dim: width of the input tokens.
        output_dim: width of the per-token update.
        hidden_dim: transformer width (384).
        num_heads: attention heads (8).
        time_depth: number of time blocks.
        space_depth: number of space blocks (0: no space attention); divides ``time_depth``.
        mlp_ratio: MLP width over ``hidden_dim`` (4).
        num_virtual_tracks: learned virtual tracks (64).
        attn_impl: ``"sdpa"`` or ``"math"``, see :func:`attention`.

    Raises:
        ValueError: ``space_depth`` does not divide ``time_depth``, space attention without virtual
            tracks, a bad ``attn_impl``, or a width not divisible by ``num_heads``.

    Example::

        >>> former = UpdateFormer(input_dim=10, output_dim=4, hidden_dim=16, num_heads=2, time_depth=2,
        ...                       space_depth=1, num_virtual_tracks=3)
        >>> former(torch.randn(2, 5, 6, 10), point_mask=torch.ones(2, 5, dtype=torch.bool)).shape
        torch.Size([2, 5, 6, 4])
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        hidden_dim: int = 384,
        num_heads: int = 8,
        time_depth: int = 6,
        space_depth: int = 6,
        mlp_ratio: float = 4.0,
        num_virtual_tracks: int = 64,
        attn_impl: str = "sdpa",
    ) -> None:
        super().__init__()
        if time_depth < 1 or space_depth < 0 or (space_depth and time_depth % space_depth):
            raise ValueError(
                f"`space_depth`={space_depth!r} must divide `time_depth`={time_depth!r} (or be 0); time_depth >= 1"
            )
        if space_depth and num_virtual_tracks < 1:
            raise ValueError(f"space attention needs virtual tracks; got `num_virtual_tracks`={num_virtual_tracks!r}")
        check_attn_impl(attn_impl)
        self.num_virtual_tracks = num_virtual_tracks
        self.space_every = time_depth // space_depth if space_depth else 0
        self.input_transform = nn.Linear(input_dim, hidden_dim)
        self.virtual_tracks = nn.Parameter(torch.randn(1, num_virtual_tracks, 1, hidden_dim))

        def blocks(count: int, cross: bool) -> nn.ModuleList:
            return nn.ModuleList(
                AttentionBlock(hidden_dim, num_heads, mlp_ratio, cross, attn_impl) for _ in range(count)
            )

        self.time_blocks = blocks(time_depth, cross=False)
        self.space_virtual_blocks = blocks(space_depth, cross=False)
        self.space_virtual_from_point_blocks = blocks(space_depth, cross=True)
        self.space_point_from_virtual_blocks = blocks(space_depth, cross=True)
        self.output_head = nn.Linear(hidden_dim, output_dim)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.output_head.weight, std=1e-3)  # start from near-zero updates

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the time and space attention blocks."""
        lists = (
            self.time_blocks,
            self.space_virtual_blocks,
            self.space_virtual_from_point_blocks,
            self.space_point_from_virtual_blocks,
        )
        return MemoryStructure(blocks=tuple(block for blocks in lists for block in blocks))

    def _space_block(self, tokens: Tensor, index: int, point_mask: Tensor | None) -> Tensor:
        batch, tracks, frames, width = tokens.shape
        space = tokens.transpose(1, 2).reshape(batch * frames, tracks, width)  # (B S) N C
        points, virtual = space.split([tracks - self.num_virtual_tracks, self.num_virtual_tracks], dim=1)
        point_rows = None if point_mask is None else point_mask.repeat_interleave(frames, dim=0)  # (B S) N
        virtual = self.space_virtual_from_point_blocks[index](virtual, points, key_mask=point_rows)
        virtual = self.space_virtual_blocks[index](virtual)
        points = self.space_point_from_virtual_blocks[index](points, virtual, query_mask=point_rows)
        space = torch.cat([points, virtual], dim=1)
        return space.reshape(batch, frames, tracks, width).transpose(1, 2)

    def forward(self, tokens: Tensor, point_mask: Tensor | None = None) -> Tensor:
        """[B, N, S, input_dim] (and optionally [B, N] bool: the points already queried) → [B, N, S, output_dim]."""
        tokens = self.input_transform(tokens)
        batch, _, frames, _ = tokens.shape
        tokens = torch.cat([tokens, self.virtual_tracks.expand(batch, -1, frames, -1)], dim=1)
        tracks = tokens.shape[1]
        for index, time_block in enumerate(self.time_blocks):
            tokens = time_block(tokens.reshape(batch * tracks, frames, -1)).reshape(batch, tracks, frames, -1)
            if self.space_every and index % self.space_every == 0:
                tokens = self._space_block(tokens, index // self.space_every, point_mask)
        return self.output_head(tokens[:, : tracks - self.num_virtual_tracks])
