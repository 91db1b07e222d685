"""The Sapiens surface-normal head: upsample a ViT feature map 8× and predict a 3-channel normal map."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_memopt.models.piecewise_recompute import (
    PieceRule,
    can_chunk,
    check_pieces,
    chunk_memory,
    chunked_conv_norm_act,
    conv_output_shape,
)
from lightning_memopt.models.structure import LeanRecompute, MemoryStructure
from lightning_memopt.models.tiled_chain import can_tile, tile_memory, tiled_conv_norm_act_chain

# the input size lean_recompute() prices a block at (it is asked before any input is seen): large enough that
# the rows and channels never cap the pieces, which the rule otherwise chooses whatever the size
NOMINAL_SIZE = (256, 256)


class ConvNormAct(nn.Sequential):
    """One head stage: a convolution, then InstanceNorm2d and SiLU (the unit activation checkpointing wraps).

    Checkpointed in ``"lean"`` mode (:meth:`checkpointed_forward`), it recomputes in chunks of
    output channels, one at a time: :attr:`chunks` of them, or where that is None the fewest
    :attr:`piece_rule` needs (:meth:`chunk_count`); one chunk is plain checkpointing. Its backward
    then holds a chunk's share again, for a few more kernels. In ``"full"`` mode it is recomputed
    whole, one forward again and nothing more; an activation budget's planner weighs both
    (:func:`~lightning_memopt.planner.plan_checkpointing`).

    Example::

        >>> import torch
        >>> stage = ConvNormAct(nn.Conv2d(4, 8, 1), 8)
        >>> stage.chunk_count((2, 4, 6, 5))   # holds 3 × 8 channels again; 1/8 of 2 × 4 + 8 is 2: all 8 chunks
        8
        >>> x = torch.randn(2, 4, 6, 5, requires_grad=True)
        >>> bool(torch.allclose(stage.checkpointed_forward(x), stage(x), atol=1e-6))
        True
    """

    chunks: int | None = None  # output-channel chunks of the lean recomputation; None: the fewest memory needs
    piece_rule: PieceRule = PieceRule()  # how few; a NormalHead gives each stage its headroom

    def __init__(self, conv: nn.Module, channels: int) -> None:
        super().__init__(conv, nn.InstanceNorm2d(channels), nn.SiLU())

    def chunk_count(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """The chunks the lean recomputation runs in for an input of ``shape`` (1: checkpointed whole).

        Raises:
            ValueError: :attr:`chunks` is neither None nor a positive integer.
        """
        check_pieces("chunks", self.chunks, automatic=True)
        if len(shape) != 4 or not can_chunk(self):
            return 1
        channels = self[0].out_channels
        if self.chunks is not None:
            return min(self.chunks, channels)
        held, floor = chunk_memory(self, shape, itemsize)
        return self.piece_rule.pieces(held, floor, most=channels)

    def checkpointed_forward(self, x: Tensor) -> Tensor:
        """The forward, keeping only ``x`` for backward, which recomputes one chunk of channels at a time.

        In one chunk, or for a stage :func:`~lightning_memopt.models.piecewise_recompute.can_chunk` refuses
        (grouped conv, running statistics, …), it is checkpointed whole.
        """
        if (chunks := self.chunk_count(x.shape, x.element_size())) > 1:
            return chunked_conv_norm_act(self, x, chunks)
        # a stage that can be chunked is deterministic: no RNG state to keep
        return checkpoint(nn.Sequential.forward, self, x, use_reentrant=False, preserve_rng_state=not can_chunk(self))

    def lean_recompute(self) -> LeanRecompute:
        """For the planner: one chunk's internals held again at a time, the forward recomputed once."""
        chunks = self.chunk_count((1, self[0].in_channels, *NOMINAL_SIZE))
        return LeanRecompute(held_fraction=1 / chunks, forwards=1.0)


class ConvNormActChain(nn.Sequential):
    """:class:`ConvNormAct` stages in a row; checkpointed in ``"lean"`` mode, the 1×1 ones recompute over tiles of rows.

    Its :meth:`checkpointed_forward` runs the whole chain over tiles of rows (:attr:`tiles` of them,
    or where that is None the fewest :attr:`piece_rule` needs: :meth:`tile_count`; one tile is plain
    checkpointing), so no full-resolution tensor of the chain exists but its input and output and
    the input gradient's buffer — for ``1 + (K + 1) / 2`` forwards of its ``K`` stages
    (:meth:`lean_recompute`). In ``"full"`` mode it is recomputed whole, one forward of the chain
    again and nothing more, holding all of it again in its backward; an activation budget's planner
    weighs both (:func:`~lightning_memopt.planner.plan_checkpointing`). State-dict keys are those of
    an ``nn.Sequential``.

    Example::

        >>> import torch
        >>> chain = ConvNormActChain(ConvNormAct(nn.Conv2d(4, 8, 1), 8), ConvNormAct(nn.Conv2d(8, 8, 1), 8))
        >>> chain.tile_count((2, 4, 6, 5))    # 5 maps of 8 channels a tile at most 1/8 of 4 + 8 + 8: all 6 rows
        6
        >>> x = torch.randn(2, 4, 6, 5, requires_grad=True)
        >>> bool(torch.allclose(chain.checkpointed_forward(x), chain(x), atol=1e-5))
        True
    """

    tiles: int | None = None  # tiles of rows of the lean recomputation (never more than the rows); None: the fewest
    piece_rule: PieceRule = PieceRule()  # how few; a NormalHead gives the chain its headroom

    def tile_count(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """The tiles the lean recomputation runs in for an input of ``shape`` (1: checkpointed whole).

        Raises:
            ValueError: :attr:`tiles` is neither None nor a positive integer.
        """
        check_pieces("tiles", self.tiles, automatic=True)
        if len(shape) != 4 or not can_tile(list(self)):
            return 1
        rows = shape[-2]
        if self.tiles is not None:
            return min(self.tiles, rows)
        held, floor = tile_memory(list(self), shape, itemsize)
        return self.piece_rule.pieces(held, floor, most=rows)

    def checkpointed_forward(self, x: Tensor) -> Tensor:
        """The forward, keeping only ``x`` for backward, which recomputes tile by tile.

        See :func:`~lightning_memopt.models.tiled_chain.tiled_conv_norm_act_chain`. In one tile, or
        for a chain with a stage that is no 1×1, stride-1, unpadded conv (or that
        :func:`~lightning_memopt.models.tiled_chain.can_tile` refuses otherwise), it is checkpointed whole.
        """
        if (tiles := self.tile_count(x.shape, x.element_size())) > 1:
            return tiled_conv_norm_act_chain(list(self), x, tiles)
        tileable = can_tile(list(self))  # then deterministic: no RNG state to keep
        return checkpoint(nn.Sequential.forward, self, x, use_reentrant=False, preserve_rng_state=not tileable)

    def lean_recompute(self) -> LeanRecompute:
        """For the planner: one tile held again at a time. Of the
        chain's K stages, backward recomputes all once for the output gradient, then for each stage k stages 1…k
        again: 1 + (K + 1) / 2 forwards of the chain (its gradient products are plain checkpointing's). Where a
        stage is wider than the last, the forward also recomputes stages 1…k for each stage's statistics: K + 2
        forwards."""
        tiles = self.tile_count((1, self[0][0].in_channels, *NOMINAL_SIZE)) if len(self) else 1
        if tiles == 1:
            return LeanRecompute(held_fraction=1.0, forwards=1.0)
        widths = [stage[0].out_channels for stage in self]
        stages = len(widths)
        forwards = 1.0 + (stages + 1) / 2 if max(widths) <= widths[-1] else stages + 2.0
        return LeanRecompute(held_fraction=1 / tiles, forwards=forwards)


class NormalHead(nn.Module):
    """Feature map ``[B, C, h, w]`` → surface normals ``[B, 3, 2ᵏh, 2ᵏw]``, raw (not unit length) by default.

    ``k`` transposed convs (kernel 4, stride 2, padding 1, no bias; each doubles the size) then
    1×1 convs, every one followed by InstanceNorm2d and SiLU (one :class:`ConvNormAct` stage each),
    then, as in the official head, ``Dropout2d`` (training only) and a final 1×1 conv to 3 channels.
    The output is raw like the official head's: callers normalise it to unit length after resizing
    it (the loss, the metrics, inference). With the published three deconv stages, a 64 × 48 feature
    map becomes a 512 × 384 normal map.

    Under "lean" activation checkpointing the deconv stages recompute in chunks of channels and the 1×1
    chain over tiles of rows, each cut into the fewest pieces memory needs (:class:`PieceRule`): the
    chain's backward holds its input, output gradient and input gradient anyway, the largest such
    floor of the head, so a deconv stage is cut only as far as its recomputation would hold more than
    that (the presets: the first two whole, the third in 2 chunks), and a tile of the chain holds at
    most 1/8 of its floor (14 tiles at the presets' 768 channels). The tiled chain costs 3 forwards of
    its three stages where plain checkpointing costs 1 and holds all of it again: the ``"lean"``
    checkpointing mode runs the former, ``"full"`` the latter, and an activation budget's planner
    weighs both (:func:`~lightning_memopt.planner.plan_checkpointing`).

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
        self._share_headroom(in_channels)

    def _share_headroom(self, in_channels: int) -> None:
        """Give each stage and the chain its :class:`PieceRule` headroom: the largest floor of the head's blocks'
        backwards (the bytes one holds however it recomputes) over its own, less one. Every floor grows with
        the map alike, so any size gives the same ratios."""
        shape: tuple[int, ...] = (1, in_channels, 16, 16)
        floors: list[tuple[nn.Module, int]] = []
        for stage in self.upsample:
            floors.append((stage, chunk_memory(stage, shape)[1]))
            shape = conv_output_shape(stage[0], shape)
        if len(self.refine):
            floors.append((self.refine, tile_memory(list(self.refine), shape)[1]))
        for stage in self.refine:
            floors.append((stage, chunk_memory(stage, shape)[1]))
            shape = conv_output_shape(stage[0], shape)
        top = max((floor for _, floor in floors), default=0)
        for block, floor in floors:
            block.piece_rule = PieceRule(headroom=top / floor - 1)

    def memory_structure(self) -> MemoryStructure:
        """Its blocks are the deconv stages and the 1×1 chain as one; its output conv is an fp32 island."""
        chain = (self.refine,) if len(self.refine) else ()
        return MemoryStructure(blocks=(*self.upsample, *chain), fp32_islands=(self.predict,))

    def forward(self, features: Tensor) -> Tensor:
        normals = self.predict(self.dropout(self.refine(self.upsample(features))))
        return F.normalize(normals, dim=1) if self.normalize_output else normals
