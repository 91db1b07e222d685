"""The lean recomputation of the normal head: channel chunks of one stage, spatial tiles of the 1×1 chain.

What is bitwise equal to the plain module (``torch.equal``) and what only within fp32 rounding
(``torch.testing.assert_close``: default fp32 tolerances for chunks, ``CHAIN_TOLERANCE`` for the
chain) because chunks and tiles change the order of summation:

* bitwise: a stage in one chunk and a chain in one tile (plain checkpointing, which they fall back
  to), and the fallbacks (plain checkpointing of a stage or chain the lean path refuses);
* within rounding: a stage in several chunks — its input gradient sums the chunks' contributions,
  and oneDNN picks its conv kernels by channel count, so the outputs and weight gradients of a
  chunk are bitwise on this CPU only for some channel counts (multiples of 8 here), never promised;
* within rounding: the tiled chain (statistics merged over tiles, instance norm's gradient in closed
  form, gradients summed over tiles), for every output and gradient, in one tile too; its 1×1 convs
  run as convolutions (TF32-eligible on CUDA), as many as its module doc counts.

How many chunks and tiles memory needs: tests/models/test_lean_pieces.py; plain or lean: test_lean_choice.py.
"""

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memopt.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_memopt.memory import profile_step
from lightning_memopt.models import create_model
from lightning_memopt.models.normal_head import ConvNormAct, ConvNormActChain, NormalHead
from lightning_memopt.models.piecewise_recompute import can_chunk
from lightning_memopt.models.tiled_chain import can_tile, row_tiles, tiled_conv_norm_act_chain


def _step(module, x, grad, forward=None, autocast=False):
    """(output, input gradient, every parameter's gradient) of one forward + backward."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = (forward or module)(x)
    output.float().backward(grad)
    return [output.detach(), x.grad, *(p.grad for p in module.parameters())]


# the tiled chain's gradients sum over tiles and passes (the statistics' gradients cancel to a small
# remainder): a few 1e-6 relative to the plain module's, just above assert_close's fp32 default of 1.3e-6
CHAIN_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _names(module):
    """The names of what :func:`_step` returns."""
    return ["output", "input", *(name for name, _ in module.named_parameters())]


def _assert_close(names, plain, lean, **tolerance):
    """``lean`` matches ``plain`` (tensors named ``names``) within fp32 rounding.

    A conv bias right before an instance norm has no effect, so its exact gradient is zero: both
    paths give rounding noise around zero, compared in absolute terms.
    """
    for name, a, b in zip(names, plain, lean, strict=True):
        if name.endswith("0.bias"):
            assert a.abs().max() < 1e-4 and b.abs().max() < 1e-4, name
        else:
            torch.testing.assert_close(b, a, **tolerance, msg=lambda message, name=name: f"{name}: {message}")


def _stage(conv, channels, affine=False):
    stage = ConvNormAct(conv, channels)
    stage[1] = nn.InstanceNorm2d(channels, affine=affine)
    if affine:  # not the initial ones and zeros, so that a wrong slice shows
        nn.init.normal_(stage[1].weight, 1.0, 0.3)
        nn.init.normal_(stage[1].bias, 0.0, 0.3)
    return stage


def _chain(channels=(6, 8, 8, 5), tiles=3):
    torch.manual_seed(0)
    pairs = enumerate(zip(channels, channels[1:], strict=False))
    chain = ConvNormActChain(*(_stage(nn.Conv2d(a, b, 1), b, affine=i == 1) for i, (a, b) in pairs))
    chain.tiles = tiles
    return chain


@pytest.mark.parametrize("transposed", [False, True], ids=["1x1", "transposed"])
def test_a_stage_in_one_chunk_is_the_plain_stage_bitwise(transposed):
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(6, 10, 4, stride=2, padding=1, bias=False) if transposed else nn.Conv2d(6, 10, 1)
    stage = _stage(conv, 10, affine=True)
    stage.chunks = 1
    x = torch.randn(2, 6, 5, 7)
    grad = torch.randn_like(stage(x))
    for plain, lean in zip(_step(stage, x, grad), _step(stage, x, grad, stage.checkpointed_forward), strict=True):
        assert torch.equal(lean, plain)


def test_a_1x1_stage_in_chunks_matches_within_rounding():
    torch.manual_seed(0)
    stage = _stage(nn.Conv2d(6, 10, 1), 10, affine=True)
    stage.chunks = 3  # 10 channels: chunks of 4, 3 and 3
    x, grad = torch.randn(2, 6, 5, 7), torch.randn(2, 10, 5, 7)
    _assert_close(_names(stage), _step(stage, x, grad), _step(stage, x, grad, stage.checkpointed_forward))


@pytest.mark.parametrize("chunks", [3, 8, 64])  # 64 > channels: one channel a chunk
def test_a_transposed_stage_in_chunks_matches_within_rounding(chunks):
    torch.manual_seed(0)
    stage = _stage(nn.ConvTranspose2d(6, 10, 4, stride=2, padding=1, bias=False), 10)
    stage.chunks = chunks
    x, grad = torch.randn(2, 6, 5, 7), torch.randn(2, 10, 10, 14)
    _assert_close(_names(stage), _step(stage, x, grad), _step(stage, x, grad, stage.checkpointed_forward))


@pytest.mark.parametrize("tiles", [1, 3, 7, 50])  # 7 rows: 3 tiles do not divide them; 50 give 7 tiles of a row
@pytest.mark.parametrize(
    "channels",
    [(6, 8, 8, 5), (6, 8, 4, 8)],
    ids=["a stage wider than the output: recomputed passes", "the output as workspace"],
)
def test_the_tiled_chain_matches_within_rounding(tiles, channels):
    chain = _chain(channels, tiles=tiles)
    x, grad = torch.randn(2, 6, 7, 5), torch.randn(2, channels[-1], 7, 5)
    plain, lean = _step(chain, x, grad), _step(chain, x, grad, chain.checkpointed_forward)
    _assert_close(_names(chain), plain, lean, **CHAIN_TOLERANCE)


@pytest.mark.parametrize("tiles", [1, 2])
def test_the_tiled_function_in_one_or_two_tiles_matches_within_rounding(tiles):
    chain = _chain((6, 8, 8, 5))  # the module would checkpoint one tile plainly: the function itself here
    x, grad = torch.randn(2, 6, 7, 5), torch.randn(2, 5, 7, 5)
    plain = _step(chain, x, grad)
    lean = _step(chain, x, grad, lambda x: tiled_conv_norm_act_chain(list(chain), x, tiles))
    assert tiled_conv_norm_act_chain(list(chain), x.requires_grad_(), tiles).grad_fn.name().startswith("TiledConv")
    _assert_close(_names(chain), plain, lean, **CHAIN_TOLERANCE)


class _Ops(TorchDispatchMode):
    """The aten ops run, by name, with the shapes of their outputs."""

    def __init__(self):
        super().__init__()
        self.shapes = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes[func.overloadpacket.__name__].append(tuple(out.shape) if isinstance(out, torch.Tensor) else None)
        return out


def test_the_tiled_chain_runs_its_1x1_convs_as_convolutions_not_matrix_products():
    chain = _chain((6, 8, 4, 8), tiles=3)  # the output as workspace: one pass a stage in the forward
    x = torch.randn(2, 6, 7, 5, requires_grad=True)
    with _Ops() as forward:
        output = tiled_conv_norm_act_chain(list(chain), x, 3)
    with _Ops() as backward:
        output.backward(torch.randn_like(output))
    stages, tiles = 3, 3
    assert len(forward.shapes["convolution"]) == stages * tiles
    # backward: all stages for the output gradient, then stages 1…k for stage k: K + K(K + 1) / 2 a tile; each
    # stage's input and weight gradient, one convolution gradient each a tile
    assert len(backward.shapes["convolution"]) == (stages + stages * (stages + 1) // 2) * tiles
    assert len(backward.shapes["convolution_backward"]) == 2 * stages * tiles
    ops = {*forward.shapes, *backward.shapes}
    assert not ops & {"mm", "addmm", "baddbmm", "matmul"}
    # the only batched products left are instance norm's gradient sums, one number per sample and channel
    assert all(shape[-2:] == (1, 1) for shape in backward.shapes["bmm"])


def test_the_statistics_are_as_accurate_as_instance_norms_far_from_zero():
    chain = _chain(tiles=4)
    with torch.no_grad():
        chain[0][0].bias += 1e4  # conv outputs around 1e4 with unit spread: Σz²/N − mean² would be all rounding
        x = torch.randn(2, 6, 7, 5)
        exact = copy.deepcopy(chain).double()(x.double())
        plain, lean = chain(x), chain.checkpointed_forward(x)
    # fp32 holds 1e4 to about 1e-3, so both are that far from the fp64 result: the tiles add nothing
    assert (lean - exact).abs().max() <= 1.5 * (plain - exact).abs().max()


def test_row_tiles_cover_the_rows_and_never_outnumber_them():
    assert row_tiles(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert row_tiles(3, 8) == [(0, 1), (1, 2), (2, 3)]


def _assert_bf16_close(names, plain, lean):
    """Within bf16 rounding: 5 % of each tensor's largest magnitude (conv biases before a norm: see _assert_close)."""
    for name, a, b in zip(names, plain, lean, strict=True):
        if name.endswith("0.bias"):
            continue  # its exact gradient is zero; in bf16 both are noise of a few 1e-2
        scale = a.float().abs().max().item()
        torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05 * scale, msg=name)


def test_under_bf16_autocast_the_lean_paths_are_as_close_as_bf16_allows():
    chain = _chain()
    x, grad = torch.randn(2, 6, 7, 5), torch.randn(2, 5, 7, 5)
    plain = _step(chain, x, grad, autocast=True)
    lean = _step(chain, x, grad, chain.checkpointed_forward, autocast=True)
    assert lean[0].dtype == plain[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in lean[1:])
    _assert_bf16_close(_names(chain), plain, lean)
    stage = _stage(nn.ConvTranspose2d(6, 10, 4, stride=2, padding=1, bias=False), 10, affine=True)
    x, grad = torch.randn(2, 6, 5, 7), torch.randn(2, 10, 10, 14)
    plain = _step(stage, x, grad, autocast=True)
    lean = _step(stage, x, grad, stage.checkpointed_forward, autocast=True)
    _assert_bf16_close(_names(stage), plain, lean)


def _replace(stage, index, module):
    stage[index] = module
    return stage


@pytest.mark.parametrize(
    "stage",
    [
        lambda: _stage(nn.Conv2d(4, 6, 1, groups=2), 6),
        lambda: ConvNormAct(nn.Conv2d(4, 6, 1), 6).append(nn.Identity()),
        lambda: _replace(ConvNormAct(nn.Conv2d(4, 6, 1), 6), 2, nn.Softmax(dim=1)),
        lambda: _replace(ConvNormAct(nn.Conv2d(4, 6, 1), 6), 1, nn.GroupNorm(2, 6)),
    ],
    ids=["grouped conv", "four modules", "channel-mixing activation", "group norm"],
)
def test_a_stage_that_cannot_be_chunked_is_checkpointed_whole_bitwise(stage):
    torch.manual_seed(0)
    stage = stage()
    assert not can_chunk(stage)
    x, grad = torch.randn(2, 4, 5, 3), torch.randn(2, 6, 5, 3)
    for plain, lean in zip(_step(stage, x, grad), _step(stage, x, grad, stage.checkpointed_forward), strict=True):
        assert torch.equal(lean, plain)


def test_running_statistics_are_refused():
    stage = ConvNormAct(nn.Conv2d(4, 6, 1), 6)
    stage[1] = nn.InstanceNorm2d(6, track_running_stats=True)
    assert not can_chunk(stage) and not can_tile([stage])


def test_a_chain_with_a_3x3_conv_is_checkpointed_whole_bitwise():
    chain = _chain()
    chain[1][0] = nn.Conv2d(8, 8, 3, padding=1)
    assert not can_tile(list(chain))
    x, grad = torch.randn(2, 6, 7, 5), torch.randn(2, 5, 7, 5)
    for plain, lean in zip(_step(chain, x, grad), _step(chain, x, grad, chain.checkpointed_forward), strict=True):
        assert torch.equal(lean, plain)


def test_frozen_parameters_and_an_input_without_gradient():
    chain = _chain()
    chain[0].requires_grad_(False)
    x = torch.randn(2, 6, 7, 5)  # no gradient wanted: only the trainable parameters get one
    trainable = {name: p for name, p in chain.named_parameters() if p.requires_grad}
    plain = torch.autograd.grad(chain(x).square().sum(), list(trainable.values()))
    lean = torch.autograd.grad(tiled_conv_norm_act_chain(list(chain), x, 3).square().sum(), list(trainable.values()))
    _assert_close(list(trainable), plain, lean, **CHAIN_TOLERANCE)


def test_the_chain_refuses_gradients_of_gradients():
    chain = _chain()
    x = torch.randn(2, 6, 7, 5, requires_grad=True)
    (grad_x,) = torch.autograd.grad(chain.checkpointed_forward(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_x.sum().backward()


def test_sapiens_checkpointed_leanly_gives_the_gradients_of_the_plain_model():
    def gradients(checkpointed):
        torch.manual_seed(0)
        model = create_model("sapiens_tiny").train()
        if checkpointed:
            assert apply_activation_checkpointing(model, "lean") == 6  # 2 ViT blocks, 3 deconv stages, the chain
        torch.manual_seed(1)  # the head's Dropout2d draws from here
        model(torch.randn(2, 3, 64, 48)).square().mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def _head_activation_peak(policy):
    """The activation peak of one fake-mode step of a 64-channel head on a 16 × 12 map (output 128 × 96)."""

    def prepare(head):
        for parameter in head.parameters():
            parameter.grad = torch.zeros_like(parameter)
        apply_activation_checkpointing(head, policy)

    profile = profile_step(
        lambda: NormalHead(64, deconv_channels=(64,) * 3, conv_channels=(64,) * 3),
        (torch.randn(1, 64, 16, 12),),
        loss_fn=lambda head, batch: head(*batch).square().mean(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        mode="fake",
        steps=1,
        prepare_model=prepare,
    )
    static = sum(profile.breakdown[key] for key in ("parameters", "gradients", "inputs", "optimizer_state"))
    return profile.peak_bytes - static, profile


def test_the_lean_recomputation_lowers_the_heads_activation_peak():
    full_size = 64 * 128 * 96 * 4  # one full-resolution tensor of the head: 3 MiB
    # before: every stage checkpointed on its own, plainly
    before, _ = _head_activation_peak(["upsample.*", "refine.*"])
    after, profile = _head_activation_peak("lean")
    assert profile.peak_phase == "backward"
    # live at the peak: the chain's input, its output gradient, its input gradient, and tiles
    assert after < 4 * full_size and after < 0.55 * before  # 3.7 and 7.3 full-size tensors
    assert max(record.nbytes for record in profile.largest if record.category == "temporaries") <= full_size


def test_remove_restores_the_plain_forward():
    model = create_model("sapiens_tiny")
    apply_activation_checkpointing(model, "auto")
    assert remove_activation_checkpointing(model) == 6
    assert "forward" not in vars(model.head.refine)
