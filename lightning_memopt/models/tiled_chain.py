"""A chain of 1×1 conv → InstanceNorm2d → activation stages recomputed over tiles of rows.

:func:`tiled_conv_norm_act_chain` keeps for backward only the chain's input and each stage's
instance-norm statistics (two numbers per sample and channel). The map is flattened to
``[B, C, H·W]`` and a tile of rows is a range of its columns; each 1×1 conv runs on a tile as a
convolution (of the tile as an ``n × 1`` image), its gradients as convolution gradients
(``torch.nn.grad``), so cuDNN runs them in TF32 where torch lets fp32 convolutions use it (its
default) as it does the unchecked head's; as a matrix product (``bmm``) they would get TF32 only
where fp32 matmuls may (not by default). The conv bias is left out: the instance norm right after it
subtracts it again, so the output is the same and the bias's gradient is exactly zero.

Forward, one pass over the tiles per stage: each conv output is copied over the one before in the
output buffer (where no stage is wider than the last; otherwise each stage's pass recomputes the
stages before it), and each tile's mean and variance come from one fp32 ``var_mean``, merged at
once by Chan et al.'s formula. That is one read of the data and as accurate as instance norm's own
(a single pass of sums and sums of squares would lose everything to Σz² − N·mean² on a map far from
zero). A last pass normalises and activates the buffer.

Backward: instance norm's gradient is closed-form, ``dz = γ·rstd·(g − mean(g) − ẑ·mean(g·ẑ))`` with
``g`` the gradient at the norm's output and ``ẑ`` the normalised conv output, so each stage needs two
whole-map sums per channel before any tile's ``dz``. A first pass recomputes the chain tile by tile,
turns the output gradient into the last stage's ``g``, stores it in the input gradient's buffer and
sums it; then, last stage first, one pass per stage recomputes the stages before it, forms ``dz``
from the stored ``g``, adds up the weight gradient and writes the next stage's ``g`` (at the first
stage: the input gradient) in its place. With ``K`` stages that is ``K + K(K + 1)/2`` conv forwards
and ``2K`` conv gradient products in backward, against ``K`` and ``2K`` for plain checkpointing.
Only the activation's derivative goes through autograd, one call per tile and pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_memopt.models.piecewise_recompute import (
    Stage,
    check_pieces,
    elementwise_activation,
    input_statistics_norm,
)

# tile-sized tensors (of the widest stage) that one tile of the backward holds at once: the stage input,
# its pre-activation (kept for the activation's derivative) and its centred conv output, the next
# stage's conv output turned into its gradient in place, and the input gradient the conv's gradient makes
TILE_TENSORS = 5


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
        and stage[0].groups == 1
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


def tile_memory(stages: Sequence[Sequence[nn.Module]], shape: Sequence[int], itemsize: int = 4) -> tuple[int, int]:
    """``(held, floor)``: what the tiled chain's backward holds at once in one tile, and what it holds however it is
    tiled (its input, its output gradient and the buffer of its input gradient), for an input of ``shape``.

    Example::

        >>> stages = [(nn.Conv2d(8, 8, 1), nn.InstanceNorm2d(8), nn.SiLU())] * 3
        >>> tile_memory(stages, (1, 8, 4, 4))   # 5 and 3 maps of 8 × 4 × 4 fp32
        (2560, 1536)
    """
    batch, channels, height, width = shape
    widths = [channels, *(stage[0].out_channels for stage in stages)]
    pixels = batch * height * width * itemsize
    return TILE_TENSORS * max(widths[1:]) * pixels, (widths[0] + widths[-1] + max(widths)) * pixels


def tiled_conv_norm_act_chain(stages: Sequence[Sequence[nn.Module]], x: Tensor, tiles: int) -> Tensor:
    """The chain of ``(conv, norm, activation)`` stages over ``x`` in ``tiles`` tiles of rows; see the module doc.

    Keeps only ``x`` for backward (and the statistics, two numbers per sample and channel and
    stage); backward recomputes tile by tile. Autocast is honoured (the convs run in its dtype, the
    statistics in fp32). The stages must pass :func:`can_tile`.

    Raises:
        ValueError: ``tiles`` is not a positive integer.

    Example::

        >>> stages = [(nn.Conv2d(4, 6, 1), nn.InstanceNorm2d(6), nn.SiLU()),
        ...           (nn.Conv2d(6, 5, 1), nn.InstanceNorm2d(5, affine=True), nn.SiLU())]
        >>> x = torch.randn(2, 4, 7, 3, requires_grad=True)
        >>> lean = tiled_conv_norm_act_chain(stages, x, tiles=3)
        >>> plain = nn.Sequential(*(nn.Sequential(*stage) for stage in stages))(x)
        >>> lean.shape, bool(torch.allclose(lean, plain, atol=1e-5))
        (torch.Size([2, 5, 7, 3]), True)
    """
    check_pieces("tiles", tiles)
    chain = _Chain([tuple(stage) for stage in stages], x.shape, tiles)  # type: ignore[misc]
    return _tiled_chain_function(x.device.type).apply(chain, x, *chain.parameters())


def _conv(weight: Tensor, h: Tensor) -> Tensor:
    """The 1×1 conv of ``weight`` ``[out, in, 1, 1]`` over ``h`` ``[B, in, pixels]``: ``[B, out, pixels]``."""
    return F.conv2d(h.unsqueeze(-1), weight).squeeze(-1)


def _conv_input_grad(weight: Tensor, grad: Tensor) -> Tensor:
    """The gradient at the input of :func:`_conv` from ``grad`` ``[B, out, pixels]`` at its output."""
    size = (grad.shape[0], weight.shape[1], grad.shape[2], 1)
    return torch.nn.grad.conv2d_input(size, weight, grad.unsqueeze(-1)).squeeze(-1)


def _conv_weight_grad(h: Tensor, weight: Tensor, grad: Tensor) -> Tensor:
    """The gradient of :func:`_conv`'s ``weight`` from its input ``h`` and ``grad`` at its output, summed over B."""
    return torch.nn.grad.conv2d_weight(h.unsqueeze(-1), weight.shape, grad.unsqueeze(-1))


Affine = tuple[Tensor, Tensor]  # per sample and channel, [B, C, 1], fp32: normalised = z · scale + shift


class _Chain:
    """The stages of a tiled chain, its tiles (ranges of the flattened pixels) and the passes over them."""

    def __init__(self, stages: list[Stage], shape: Sequence[int], tiles: int) -> None:
        self.stages = stages
        self.shape = tuple(shape)
        height, width = shape[-2:]
        self.pixels = height * width
        self.tiles = [(top * width, bottom * width) for top, bottom in row_tiles(height, tiles)]
        self.widths = [shape[1], *(conv.out_channels for conv, _, _ in stages)]
        self.dtype = torch.float32  # the dtype the convs run in: autocast's, else the input's (set by prepare)
        self.weights: list[Tensor] = []

    def parameters(self) -> list[Tensor]:
        """The live parameters, stage by stage: conv weight, conv bias, norm weight, norm bias (those present)."""
        return [p for stage, kind in self.slots() if (p := self.parameter(stage, kind)) is not None]

    def slots(self) -> list[tuple[int, int]]:
        """``(stage, kind)`` of each of :meth:`parameters` (kind 0…3 as listed there)."""
        return [(i, k) for i in range(len(self.stages)) for k in range(4) if self.parameter(i, k) is not None]

    def parameter(self, stage: int, kind: int) -> Tensor | None:
        conv, norm, _ = self.stages[stage]
        return (conv.weight, conv.bias, norm.weight, norm.bias)[kind]

    def prepare(self, dtype: torch.dtype) -> None:
        """Cast each conv weight once to the compute dtype."""
        self.dtype = dtype
        self.weights = [conv.weight.detach().to(dtype) for conv, _, _ in self.stages]

    def affine(self, index: int, mean: Tensor, rstd: Tensor) -> Affine:
        norm = self.stages[index][1]
        scale = rstd if norm.weight is None else rstd * norm.weight.detach()
        shift = -mean * scale if norm.bias is None else norm.bias.detach() - mean * scale
        return scale[..., None], shift[..., None]

    def norm_act(self, index: int, z: Tensor, affine: Affine) -> Tensor:
        """Instance norm of the conv output ``z`` by its whole-map ``affine`` (in fp32), then the activation."""
        return self.stages[index][2](torch.addcmul(affine[1], z, affine[0]).to(self.dtype))

    def run(self, tile: Tensor, affines: Sequence[Affine], stages: int) -> Tensor:
        """The first ``stages`` stages on the input ``tile``."""
        h = tile.to(self.dtype)
        for index in range(stages):
            h = self.norm_act(index, _conv(self.weights[index], h), affines[index])
        return h

    def statistics(self, index: int, moments: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Stage ``index``'s whole-map (mean, 1 / std) from its tiles' (variance, mean), merged by Chan's formula."""
        eps = self.stages[index][1].eps
        if len(moments) == 1:
            var, mean = moments[0]
        else:
            variances, means = (torch.stack(values) for values in zip(*moments, strict=True))
            sizes = [(bottom - top) / self.pixels for top, bottom in self.tiles]
            weights = torch.tensor(sizes, dtype=torch.float32, device=means.device)[:, None, None]
            mean = (weights * means).sum(0)
            var = (weights * (variances + (means - mean).square())).sum(0)
        return mean, torch.rsqrt(var + eps)

    def forward(self, x: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The chain's output and each stage's whole-map (mean, 1 / std) per sample and channel, fp32."""
        flat = x.reshape(x.shape[0], self.widths[0], self.pixels)
        widths, count = self.widths, len(self.stages)
        workspace = max(widths[1:]) <= widths[-1]  # conv outputs written over each other in the output buffer
        out = flat.new_empty((flat.shape[0], widths[-1], self.pixels), dtype=self.dtype)
        stats: list[tuple[Tensor, Tensor]] = []
        affines: list[Affine] = []
        # in fp32 the stage's whole conv output ends up in the buffer: one var_mean over it, not one per tile
        whole = workspace and self.dtype == torch.float32
        for index in range(count):
            moments = [
                self.forward_tile(flat, out, index, top, bottom, affines, workspace) for top, bottom in self.tiles
            ]
            if whole:
                moments = [torch.var_mean(out[:, : widths[index + 1]], dim=2, correction=0)]
            stats.append(self.statistics(index, moments))  # type: ignore[arg-type]
            affines.append(self.affine(index, *stats[-1]))
        for top, bottom in self.tiles:
            if workspace:
                tile = out[:, :, top:bottom]
                tile.copy_(self.norm_act(count - 1, tile, affines[-1]))
            else:
                out[:, :, top:bottom] = self.run(flat[:, :, top:bottom], affines, count)
        return out.view(flat.shape[0], widths[-1], *self.shape[2:]), stats

    def forward_tile(
        self, flat: Tensor, out: Tensor, index: int, top: int, bottom: int, affines: list[Affine], workspace: bool
    ) -> tuple[Tensor, Tensor] | None:
        """Stage ``index``'s conv output on a tile (copied to the buffer where it is the workspace); its (var, mean)
        in fp32 unless the whole stage's are taken from the buffer in fp32 at once."""
        if not workspace:
            z = _conv(self.weights[index], self.run(flat[:, :, top:bottom], affines, index))
            return torch.var_mean(z.float(), dim=2, correction=0)
        if index:
            h = self.norm_act(index - 1, out[:, : self.widths[index], top:bottom], affines[-1])
        else:
            h = flat[:, :, top:bottom].to(self.dtype)
        z = _conv(self.weights[index], h)
        del h
        out[:, : self.widths[index + 1], top:bottom].copy_(z)
        return None if z.dtype == torch.float32 else torch.var_mean(z.float(), dim=2, correction=0)


@functools.cache
def _tiled_chain_function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd Function of the tiled chain for one device type (autocast is per device type)."""

    class TiledConvNormActChain(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx: Any, chain: _Chain, x: Tensor, *parameters: Tensor) -> Tensor:
            autocast = torch.is_autocast_enabled(device_type)
            with torch.autocast(device_type, enabled=False):  # the dtypes are explicit from here on
                chain.prepare(torch.get_autocast_dtype(device_type) if autocast else x.dtype)
                out, stats = chain.forward(x)
            chain.weights = []
            ctx.chain = chain
            ctx.save_for_backward(x, *(value for pair in stats for value in pair))
            return out

        @staticmethod
        @once_differentiable  # its backward is no graph of its own: no gradients of gradients
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
            x, *flat = ctx.saved_tensors
            stats = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
            with torch.autocast(device_type, enabled=False):
                ctx.chain.prepare(ctx.chain.dtype)
                grads = _Backward(ctx.chain, x, stats, ctx.needs_input_grad[1:]).run(grad)
            ctx.chain.weights = []
            return (None, *grads)

    return TiledConvNormActChain


class _Backward:
    """The backward passes of a tiled chain (see the module doc): one for the output gradient, one per stage."""

    def __init__(self, chain: _Chain, x: Tensor, stats: list[tuple[Tensor, Tensor]], needs: Sequence[bool]) -> None:
        self.chain, self.stats = chain, stats
        self.flat = x.reshape(x.shape[0], chain.widths[0], chain.pixels)
        self.x = x
        self.need_x = needs[0]
        count = len(chain.stages)
        wanted = [slot for slot, need in zip(chain.slots(), needs[1:], strict=True) if need]
        self.wanted = wanted
        self.need_weight = [(index, 0) in wanted for index in range(count)]
        need_norm = [(index, 2) in wanted or (index, 3) in wanted for index in range(count)]
        # the last stage whose pass must run: the first stage, for the input gradient; else the first one with a conv
        # weight to train, or just after the first one with a norm to train (whose sums the pass after it gives)
        lowest = [index for index in range(count) if self.need_weight[index]]
        lowest += [index + 1 for index in range(count) if need_norm[index]]
        self.stop = 0 if self.need_x else min(lowest, default=count + 1)
        self.need_sums = [need_norm[index] or index >= self.stop for index in range(count)]
        self.affines = [chain.affine(index, *pair) for index, pair in enumerate(stats)]
        self.sums: list[tuple[Tensor, Tensor] | None] = [None] * count  # Σ g and Σ g·(z − mean) per sample and channel
        self.weight_grads: list[Tensor | None] = [None] * count

    def run(self, grad: Tensor) -> list[Tensor | None]:
        chain, count = self.chain, len(self.chain.stages)
        if self.stop > count:  # nothing wanted but conv biases: their gradients are zero
            return self.gradients()
        widths = chain.widths
        buffer_width = max(widths if self.need_x else widths[1:])
        batch = self.flat.shape[0]
        # g of each stage in turn, then the input gradient: the buffer the input gradient is returned in
        self.buffer = self.flat.new_empty((batch, buffer_width, chain.pixels), dtype=chain.dtype)
        output_grad = grad.reshape(batch, widths[-1], chain.pixels)
        # each tile in a function of its own: its tensors are freed before the next tile's are made
        parts = [self.output_tile(top, bottom, output_grad) for top, bottom in chain.tiles]
        self.sums[count - 1] = self.add_up(parts)
        for index in reversed(range(self.stop, count)):
            self.stage_pass(index)
        return self.gradients()

    def output_tile(self, top: int, bottom: int, output_grad: Tensor) -> tuple[Tensor, Tensor]:
        """The output gradient on a tile through the last stage's activation: that stage's ``g``, kept, and sums."""
        index = len(self.chain.stages) - 1
        centred, pre, post = self.recompute(top, bottom, index)
        g = torch.autograd.grad(post, pre, output_grad[:, :, top:bottom])[0]
        del pre, post
        return self.store(g, centred, top, bottom, index)

    def recompute(self, top: int, bottom: int, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """Stage ``index`` on a tile: its centred conv output (fp32), its pre-activation (a leaf) and its output."""
        chain = self.chain
        h = chain.run(self.flat[:, :, top:bottom], self.affines, index)
        z = _conv(chain.weights[index], h)
        del h
        centred = z - self.stats[index][0][..., None]
        scale, shift = self.affines[index]
        pre = torch.addcmul(shift, z, scale).to(chain.dtype).requires_grad_()
        del z
        act = chain.stages[index][2]
        with torch.enable_grad():
            post = act(pre.clone() if getattr(act, "inplace", False) else pre)
        return centred, pre, post

    def store(self, g: Tensor, centred: Tensor, top: int, bottom: int, index: int) -> tuple[Tensor, Tensor]:
        """Keep stage ``index``'s ``g`` on a tile in the buffer (where a later pass needs it); its two sums."""
        if index >= self.stop:
            self.buffer[:, : self.chain.widths[index + 1], top:bottom].copy_(g)
        g = g.float()
        return g.sum(2), torch.einsum("bcn,bcn->bc", g, centred)

    def add_up(self, parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        if len(parts) == 1:
            return parts[0]
        return torch.stack([s for s, _ in parts]).sum(0), torch.stack([s for _, s in parts]).sum(0)

    def stage_pass(self, index: int) -> None:
        """Stage ``index``'s conv-output gradient tile by tile: its weight gradient, and the stage before's ``g``."""
        total, centred_sum = self.sums[index]  # type: ignore[misc]
        mean, rstd = self.stats[index]
        norm = self.chain.stages[index][1]
        gain = rstd if norm.weight is None else rstd * norm.weight.detach()
        # dz = gain · (g − Σg / N − (z − mean) · rstd² · Σ g(z − mean) / N) = gain · g + slope · (z − mean) + offset
        slope = -gain * rstd.square() * centred_sum / self.chain.pixels
        offset = -gain * total / self.chain.pixels
        coefficients = (mean[..., None], gain[..., None], slope[..., None], offset[..., None])
        parts = [self.stage_tile(index, top, bottom, coefficients) for top, bottom in self.chain.tiles]
        if index and self.need_sums[index - 1]:
            self.sums[index - 1] = self.add_up([part for part in parts if part is not None])

    def stage_tile(
        self, index: int, top: int, bottom: int, coefficients: tuple[Tensor, Tensor, Tensor, Tensor]
    ) -> tuple[Tensor, Tensor] | None:
        """Stage ``index`` on a tile: ``dz``, its weight gradient, and the stage before's ``g`` (kept) and sums."""
        chain, widths = self.chain, self.chain.widths
        mean, gain, slope, offset = coefficients
        before = index - 1
        if index:
            centred, pre, post = self.recompute(top, bottom, before)
            h = post  # the stage's input (grad mode is off: the products below record nothing)
        else:
            h = self.flat[:, :, top:bottom].to(chain.dtype)
        weight = chain.weights[index]
        z = _conv(weight, h)
        dz = z.sub_(mean) if z.dtype == torch.float32 else z - mean
        del z
        torch.addcmul(offset, dz, slope, out=dz)
        dz = dz.addcmul_(self.buffer[:, : widths[index + 1], top:bottom], gain).to(chain.dtype)
        if self.need_weight[index]:
            self.add_weight_grad(index, dz, h)
        del h
        if index and self.need_sums[before]:
            target = _conv_input_grad(weight, dz)
            del dz
            g = torch.autograd.grad(post, pre, target)[0]
            del pre, post, target
            return self.store(g, centred, top, bottom, before)
        if not index and self.need_x:
            self.buffer[:, : widths[0], top:bottom].copy_(_conv_input_grad(weight, dz))
        return None

    def add_weight_grad(self, index: int, dz: Tensor, h: Tensor) -> None:
        """Add stage ``index``'s weight gradient on a tile (in fp32, summed over the batch) to the stage's total."""
        grad = _conv_weight_grad(h, self.chain.weights[index], dz)
        found = self.weight_grads[index]
        if found is None:
            self.weight_grads[index] = grad.float()
        else:
            found.add_(grad)

    def gradients(self) -> list[Tensor | None]:
        """The input gradient, then each parameter's (None where none is wanted)."""
        chain = self.chain
        grad_x = None
        if self.need_x:
            grad_x = self.buffer[:, : chain.widths[0]].reshape(self.x.shape).to(self.x.dtype)
        found: list[Tensor | None] = [grad_x]
        for index, kind in chain.slots():
            parameter = chain.parameter(index, kind)
            assert parameter is not None
            if (index, kind) not in self.wanted:
                found.append(None)
            elif kind == 0:
                total = self.weight_grads[index]
                found.append(None if total is None else total.to(parameter.dtype))
            elif kind == 1:  # the conv bias right before an instance norm: no effect, so exactly zero
                found.append(torch.zeros_like(parameter))
            else:
                total, centred_sum = self.sums[index]  # type: ignore[misc]
                value = (centred_sum * self.stats[index][1]).sum(0) if kind == 2 else total.sum(0)
                found.append(value.to(parameter.dtype))
        return found
