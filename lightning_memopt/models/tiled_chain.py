"""A chain of 1×1 conv → InstanceNorm2d → activation stages recomputed over tiles of rows.

:func:`tiled_conv_norm_act_chain` keeps nothing of the chain's size but its input and output.
Instance norm wants statistics over the whole map: a custom autograd Function gathers them in
passes over the tiles (Chan's combination of per-tile means and centred sums of squares, in fp32),
saves only the input for backward, and in backward treats the statistics as leaves: one pass
back-propagates the output gradient tile by tile, then, last stage first, one pass per stage turns
the gradient of its statistics into a cotangent on its conv output and back-propagates that.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_memopt.models.lean_recompute import Stage, elementwise_activation, input_statistics_norm


def can_tile(stages: Sequence[Sequence[nn.Module]]) -> bool:
    """Whether :func:`tiled_conv_norm_act_chain` can run ``stages``: 1×1, stride-1, unpadded Conv2d stages.

    Example::

        >>> can_tile([(nn.Conv2d(4, 4, 1), nn.InstanceNorm2d(4), nn.SiLU())])
        True
        >>> can_tile([(nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4), nn.SiLU())])
        False
    """
    return bool(stages) and all(
        len(stage) == 3
        and type(stage[0]) is nn.Conv2d
        and stage[0].kernel_size == (1, 1)
        and stage[0].stride == (1, 1)
        and stage[0].padding in ((0, 0), "valid")
        and input_statistics_norm(stage[1])
        and elementwise_activation(stage[2])
        for stage in stages
    )


def row_tiles(height: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` near-equal ranges of rows ``(top, bottom)`` covering ``height`` rows; never more than the rows.

    Example::

        >>> row_tiles(7, 3)
        [(0, 2), (2, 4), (4, 7)]
    """
    count = max(1, min(tiles, height))
    bounds = [index * height // count for index in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def tiled_conv_norm_act_chain(stages: Sequence[Sequence[nn.Module]], x: Tensor, tiles: int) -> Tensor:
    """The chain of ``(conv, norm, activation)`` stages over ``x`` in ``tiles`` tiles of rows; see the module doc.

    Keeps only ``x`` for backward (and the statistics, two numbers per sample and channel and
    stage); backward recomputes tile by tile. Autocast is honoured (backward recomputes under the
    forward's autocast state); the statistics are fp32. The stages must pass :func:`can_tile`.

    Example::

        >>> stages = [(nn.Conv2d(4, 6, 1), nn.InstanceNorm2d(6), nn.SiLU()),
        ...           (nn.Conv2d(6, 5, 1), nn.InstanceNorm2d(5, affine=True), nn.SiLU())]
        >>> x = torch.randn(2, 4, 7, 3, requires_grad=True)
        >>> lean = tiled_conv_norm_act_chain(stages, x, tiles=3)
        >>> plain = nn.Sequential(*(nn.Sequential(*stage) for stage in stages))(x)
        >>> lean.shape, bool(torch.allclose(lean, plain, atol=1e-5))
        (torch.Size([2, 5, 7, 3]), True)
    """
    chain = _Chain([tuple(stage) for stage in stages], x.shape[-2], tiles)  # type: ignore[misc]
    return _tiled_chain_function(x.device.type).apply(chain, x, *chain.parameters())


class _Chain:
    """The stages of a tiled chain, its tiles of rows, and the functional stage it evaluates on a tile."""

    def __init__(self, stages: list[Stage], height: int, tiles: int) -> None:
        self.stages = stages
        self.tiles = row_tiles(height, tiles)

    def parameters(self) -> list[Tensor]:
        """The live parameters, stage by stage: conv weight, conv bias, norm weight, norm bias (those present)."""
        found: list[Tensor] = []
        for conv, norm, _ in self.stages:
            found += [p for p in (conv.weight, conv.bias, norm.weight, norm.bias) if p is not None]
        return found

    def conv(self, index: int, h: Tensor) -> Tensor:
        conv = self.stages[index][0]
        return F.conv2d(h, conv.weight, conv.bias, 1, 0, conv.dilation, conv.groups)

    def norm_act(self, index: int, z: Tensor, mean: Tensor, var: Tensor) -> Tensor:
        """Instance norm of ``z`` by the given whole-map statistics (computed in fp32), then the activation."""
        _, norm, act = self.stages[index]
        scale = torch.rsqrt(var + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight
        normalised = (z.float() - mean[:, :, None, None]) * scale[:, :, None, None]
        if norm.bias is not None:
            normalised = normalised + norm.bias[:, None, None]
        return act(normalised.to(z.dtype))

    def run(self, h: Tensor, stats: Sequence[tuple[Tensor, Tensor]], stages: int) -> Tensor:
        """The first ``stages`` stages on the tile ``h``, normalised by ``stats``."""
        for index in range(stages):
            h = self.norm_act(index, self.conv(index, h), *stats[index])
        return h

    def forward(self, x: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The chain's output and each stage's whole-map (mean, biased variance) per sample and channel, fp32.

        Where no stage has more channels than the last, the output is the workspace: each stage's
        conv output is written over its input tile by tile, so each conv runs once. Otherwise each
        stage's statistics take one pass recomputing the stages before it, then a last pass writes the output.
        """
        channels = [conv.out_channels for conv, _, _ in self.stages]
        if max(channels) > channels[-1]:
            return self._forward_recomputing(x)
        out: Tensor | None = None
        stats: list[tuple[Tensor, Tensor]] = []
        for index, width in enumerate(channels):
            moments = _Moments()
            for top, bottom in self.tiles:
                if index == 0 or out is None:
                    h = x[:, :, top:bottom]
                else:  # the previous stage's conv output, normalised and activated
                    h = self.norm_act(index - 1, out[:, : channels[index - 1], top:bottom], *stats[-1])
                z = self.conv(index, h)
                if out is None:
                    out = z.new_empty((z.shape[0], channels[-1], *x.shape[2:]))
                out[:, :width, top:bottom] = z
                moments.add(z)
            stats.append(moments.result())
        assert out is not None
        for top, bottom in self.tiles:
            out[:, :, top:bottom] = self.norm_act(len(channels) - 1, out[:, :, top:bottom], *stats[-1])
        return out, stats

    def _forward_recomputing(self, x: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        stats: list[tuple[Tensor, Tensor]] = []
        for index in range(len(self.stages)):
            moments = _Moments()
            for top, bottom in self.tiles:
                moments.add(self.conv(index, self.run(x[:, :, top:bottom], stats, index)))
            stats.append(moments.result())
        out: Tensor | None = None
        for top, bottom in self.tiles:
            tile = self.run(x[:, :, top:bottom], stats, len(stats))
            if out is None:
                out = tile.new_empty((*tile.shape[:2], *x.shape[2:]))
            out[:, :, top:bottom] = tile
        assert out is not None
        return out, stats


class _Moments:
    """Per sample and channel mean and centred sum of squares over tiles, merged by Chan et al.'s formula, fp32."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, z: Tensor) -> None:
        var, mean = torch.var_mean(z.float(), dim=(2, 3), correction=0)
        size = z.shape[2] * z.shape[3]
        if self.mean is None or self.m2 is None:
            self.mean, self.m2 = mean, var * size
        else:
            delta = mean - self.mean
            total = self.count + size
            self.mean = self.mean + delta * (size / total)
            self.m2 = self.m2 + var * size + delta.square() * (self.count * size / total)
        self.count += size

    def result(self) -> tuple[Tensor, Tensor]:
        """(mean, biased variance), as instance norm normalises by."""
        assert self.mean is not None and self.m2 is not None
        return self.mean, self.m2 / self.count


@functools.cache
def _tiled_chain_function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function of the tiled chain for one device type (autocast is per device type)."""

    class TiledConvNormActChain(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx: Any, chain: _Chain, x: Tensor, *parameters: Tensor) -> Tensor:
            out, stats = chain.forward(x)
            ctx.chain = chain
            ctx.save_for_backward(x, *(value for pair in stats for value in pair))
            return out

        @staticmethod
        @once_differentiable  # its backward is no graph of its own: no gradients of gradients
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
            x, *flat = ctx.saved_tensors
            return (None, *_tiled_backward(ctx.chain, x, flat, grad, ctx.needs_input_grad[1]))

    return TiledConvNormActChain


def _tiled_backward(chain: _Chain, x: Tensor, flat: list[Tensor], grad: Tensor, need_x: bool) -> list[Tensor | None]:
    """Gradients of the input and of every parameter of the chain; see the module doc."""
    stats = [(flat[i].detach().requires_grad_(), flat[i + 1].detach().requires_grad_()) for i in range(0, len(flat), 2)]
    parameters = chain.parameters()
    wanted = [p for p in parameters if p.requires_grad]
    grad_x = torch.zeros_like(x) if need_x else None
    sums: dict[int, Tensor] = {}  # gradients summed over tiles and passes, by id of the parameter or statistic

    def back(output: Tensor, cotangent: Tensor, rows: tuple[int, int], tile: Tensor, leaves: list[Tensor]) -> None:
        """Back-propagate ``cotangent`` from ``output``, made of ``tile`` (those rows of ``x``) and ``leaves``."""
        inputs = [tile, *leaves] if need_x else leaves
        if not output.requires_grad or not inputs:  # frozen stages, an input without gradient
            return
        grads = list(torch.autograd.grad(output, inputs, cotangent, allow_unused=True))
        if need_x and (grad_tile := grads.pop(0)) is not None:
            assert grad_x is not None
            grad_x[:, :, rows[0] : rows[1]] += grad_tile
        for leaf, value in zip(leaves, grads, strict=True):
            if value is not None:
                sums[id(leaf)] = sums[id(leaf)] + value if id(leaf) in sums else value

    def tile_of(top: int, bottom: int) -> Tensor:
        return x[:, :, top:bottom].detach().requires_grad_(need_x)

    stat_leaves = [value for pair in stats for value in pair]
    for rows in chain.tiles:  # the output gradient, the statistics held fixed
        with torch.enable_grad():
            tile = tile_of(*rows)
            output = chain.run(tile, stats, len(chain.stages))
            back(output, grad[:, :, rows[0] : rows[1]], rows, tile, wanted + stat_leaves)
    count = x.shape[2] * x.shape[3]
    for index in reversed(range(len(chain.stages))):  # then what each stage's statistics pass on, last stage first
        mean, var = stats[index]
        # d mean / dz = 1 / count, d var / dz = 2 (z - mean) / count
        grad_mean, grad_var = (sums.get(id(leaf), torch.zeros_like(leaf))[:, :, None, None] for leaf in (mean, var))
        earlier = [value for pair in stats[:index] for value in pair]
        for rows in chain.tiles:
            with torch.enable_grad():
                tile = tile_of(*rows)
                z = chain.conv(index, chain.run(tile, stats, index))
                cotangent = z.detach().float() - mean.detach()[:, :, None, None]  # one tile, then in place
                cotangent.mul_(grad_var * (2 / count)).add_(grad_mean / count)
                back(z, cotangent.to(z.dtype), rows, tile, wanted + earlier)
    return [grad_x, *(sums.get(id(p)) if p.requires_grad else None for p in parameters)]
