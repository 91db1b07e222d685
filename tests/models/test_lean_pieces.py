"""How finely the normal head's lean recomputation is cut: the fewest channel chunks and row tiles memory needs.

The choice on given sizes (the sapiens_0.3b head's, a chain with a wide stage, caps by rows and
channels), what the head tells each block (its headroom), what the blocks declare to the planner,
arguments refused by name, one piece being plain checkpointing, exactness at the chosen counts, and
the bytes a tile holds against :data:`~lightning_memopt.models.tiled_chain.TILE_TENSORS`.
"""

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import profile_step
from lightning_memopt.models.normal_head import ConvNormAct, ConvNormActChain, NormalHead
from lightning_memopt.models.piecewise_recompute import PieceRule, check_pieces, chunked_conv_norm_act
from lightning_memopt.models.structure import LeanRecompute
from lightning_memopt.models.tiled_chain import TILE_TENSORS, tile_memory, tiled_conv_norm_act_chain

# the tiled chain sums over tiles and passes: within fp32 rounding of the plain module (as test_lean_recompute.py)
CHAIN_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _sapiens_head():
    """The sapiens_0.3b head: a 1024-wide ViT map, three deconvs to 768 channels, three 1×1 stages of 768."""
    return NormalHead(1024, deconv_channels=(768,) * 3, conv_channels=(768,) * 3)


def _chain(*widths):
    return ConvNormActChain(*(ConvNormAct(nn.Conv2d(a, b, 1), b) for a, b in zip(widths, widths[1:], strict=False)))


def test_the_rule_takes_the_fewest_pieces_within_the_allowance():
    assert PieceRule().pieces(held=4.0, floor=3.0) == 11  # 4/11 ≤ 3/8 < 4/10
    assert PieceRule().pieces(held=3.0, floor=24.0) == 1  # already within 1/8 of the floor: not cut
    assert PieceRule(fraction=0.25).pieces(held=4.0, floor=3.0) == 6
    assert PieceRule(headroom=1.0).pieces(held=3.0, floor=1.5) == 2  # another block holds as much anyway
    assert PieceRule(headroom=0.01).pieces(held=4.0, floor=3.0) == 11  # a headroom below the fraction: the fraction
    assert PieceRule().pieces(held=4.0, floor=3.0, most=6) == 6  # never more than the rows or channels
    assert PieceRule().pieces(held=0.0, floor=0.0) == 1


@pytest.mark.parametrize(
    ("features", "rows"),
    [((32, 24), 256), ((64, 48), 512), ((4, 3), 32)],
    ids=["512x384 image", "1024x768 image", "sapiens_tiny's map"],
)
def test_the_sapiens_head_is_cut_where_its_memory_needs_it(features, rows):
    head = _sapiens_head()
    shape = (1, 1024, *features)
    chunks = []
    for stage in head.upsample:
        chunks.append(stage.chunk_count(shape))
        shape = (1, 768, 2 * shape[2], 2 * shape[3])
    # the chain's backward holds its input, output gradient and input gradient anyway (3 maps of 768): the
    # first two deconvs' recomputations hold less than that more, the third's twice its own floor (2 chunks)
    assert chunks == [1, 1, 2]
    assert shape[2] == rows
    # a tile holds 5 maps of 768 channels again: 1/14 of that is 5/14 ≤ 3/8 of the chain's floor
    assert head.refine.tile_count(shape) == 14
    assert head.refine.tile_count((2, 768, *shape[2:]), itemsize=2) == 14  # the batch and the dtype scale both alike


def test_the_head_gives_each_block_the_headroom_of_the_largest_floor():
    head = _sapiens_head()
    assert head.refine.piece_rule == PieceRule(headroom=0.0)  # the largest floor: its own fraction
    assert head.upsample[2].piece_rule.headroom == pytest.approx(1.0)  # 3 maps of 768 against 1.5
    assert head.upsample[1].piece_rule.headroom == pytest.approx(7.0)
    assert all(stage.piece_rule.headroom == pytest.approx(0.0) for stage in head.refine)
    assert ConvNormAct(nn.Conv2d(4, 4, 1), 4).piece_rule == PieceRule()  # alone: the fraction only


def test_a_chain_with_a_wide_stage_is_cut_by_its_widest_stage():
    chain = _chain(16, 64, 16)  # a tile holds 5 maps of 64 channels; the floor is 16 + 16 + 64 channels
    held, floor = tile_memory(list(chain), (1, 16, 40, 8))
    assert (held, floor) == (TILE_TENSORS * 64 * 320 * 4, 96 * 320 * 4)
    assert chain.tile_count((1, 16, 40, 8)) == 27  # 320 / 27 ≤ 96 / 8 < 320 / 26
    assert chain.tile_count((1, 16, 10, 8)) == 10  # never more than the rows


def test_explicit_counts_are_honoured_and_capped():
    stage = ConvNormAct(nn.ConvTranspose2d(4, 6, 4, 2, 1, bias=False), 6)
    stage.chunks = 4
    assert stage.chunk_count((1, 4, 5, 5)) == 4
    stage.chunks = 64
    assert stage.chunk_count((1, 4, 5, 5)) == 6  # one channel a chunk at most
    chain = _chain(4, 8, 8)
    chain.tiles = 16
    assert chain.tile_count((1, 4, 7, 5)) == 7
    grouped = ConvNormAct(nn.Conv2d(4, 6, 1, groups=2), 6)
    assert grouped.chunk_count((1, 4, 5, 5)) == 1  # cannot be chunked: checkpointed whole


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_bad_counts_are_refused_by_name_with_the_value_and_the_choices(value):
    stage, chain = ConvNormAct(nn.Conv2d(4, 6, 1), 6), _chain(4, 8, 8)
    stage.chunks, chain.tiles = value, value
    choices = r"must be a positive integer, or None \(the fewest that memory needs\)"
    with pytest.raises(ValueError, match=rf"`chunks`={value!r} {choices}"):
        stage.checkpointed_forward(torch.randn(1, 4, 5, 5))
    with pytest.raises(ValueError, match=rf"`tiles`={value!r} {choices}"):
        chain.lean_recompute()
    x = torch.randn(1, 4, 5, 5)
    with pytest.raises(ValueError, match=rf"`tiles`={value!r} must be a positive integer$"):
        tiled_conv_norm_act_chain(list(chain), x, value)
    with pytest.raises(ValueError, match=rf"`chunks`={value!r} must be a positive integer$"):
        chunked_conv_norm_act(stage, x, value)
    with pytest.raises(ValueError, match=rf"`tiles`={value!r} must be a positive integer$"):
        check_pieces("tiles", value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fraction": 0}, r"`fraction`=0 must be a number in \(0, 1\]"),
        ({"fraction": 1.5}, r"`fraction`=1.5 must be a number in \(0, 1\]"),
        ({"fraction": "1/8"}, r"`fraction`='1/8' must be a number in \(0, 1\]"),
        ({"headroom": -1.0}, r"`headroom`=-1.0 must be a number >= 0"),
        ({"headroom": float("nan")}, r"`headroom`=nan must be a number >= 0"),
    ],
)
def test_a_bad_rule_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        PieceRule(**options)


def test_the_planner_is_told_the_pieces_actually_used():
    head = _sapiens_head()
    assert head.upsample[0].lean_recompute() == LeanRecompute(held_fraction=1.0, forwards=1.0)
    assert head.upsample[2].lean_recompute() == LeanRecompute(held_fraction=0.5, forwards=1.0)
    # three stages: the forward, then in backward once for the output gradient and 1 + 2 + 3 stages: 3 forwards
    assert head.refine.lean_recompute() == LeanRecompute(held_fraction=1 / 14, forwards=3.0)
    head.refine.tiles = 16
    assert head.refine.lean_recompute() == LeanRecompute(held_fraction=1 / 16, forwards=3.0)
    head.refine.tiles = 1  # one tile: plain checkpointing
    assert head.refine.lean_recompute() == LeanRecompute(held_fraction=1.0, forwards=1.0)
    wide = _chain(8, 32, 8)  # a stage wider than the last: the forward recomputes for each stage's statistics too
    wide.tiles = 4
    assert wide.lean_recompute() == LeanRecompute(held_fraction=0.25, forwards=4.0)


def _step(module, x, grad, forward):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    output = forward(x)
    output.backward(grad)
    return [output.detach(), x.grad, *(p.grad for p in module.parameters())]


def test_one_piece_is_plain_checkpointing_bitwise():
    torch.manual_seed(0)
    chain, stage = _chain(6, 8, 8), ConvNormAct(nn.ConvTranspose2d(6, 8, 4, 2, 1, bias=False), 8)
    chain.tiles, stage.chunks = 1, 1
    for module, x in ((chain, torch.randn(2, 6, 7, 5)), (stage, torch.randn(2, 6, 4, 3))):
        grad = torch.randn_like(module(x))
        assert module.checkpointed_forward(x.requires_grad_()).grad_fn.name() == "SiluBackward0"  # no lean Function
        plain, lean = _step(module, x, grad, module), _step(module, x, grad, module.checkpointed_forward)
        assert all(torch.equal(a, b) for a, b in zip(plain, lean, strict=True))


def test_the_head_at_its_chosen_counts_is_as_exact_as_the_plain_head():
    """Against the head in fp64, the lean step's error is the plain fp32 step's, give or take rounding."""
    torch.manual_seed(0)
    head = NormalHead(16, deconv_channels=(8, 8, 8), conv_channels=(8, 8, 8), dropout=0.0)
    x = torch.randn(2, 16, 4, 3)
    counts = [
        stage.chunk_count(s)
        for stage, s in zip(head.upsample, [(2, 16, 4, 3), (2, 8, 8, 6), (2, 8, 16, 12)], strict=True)
    ]
    assert counts == [1, 1, 2] and head.refine.tile_count((2, 8, 32, 24)) == 14
    grad = torch.randn(2, 3, 32, 24)
    plain = _step(head, x, grad, head)
    exact = _step(head.double(), x.double(), grad.double(), head)
    head.float()
    apply_activation_checkpointing(head, "lean")
    lean = _step(head, x, grad, head)
    names = ["output", "input", *(name for name, _ in head.named_parameters())]
    for name, a, b, e in zip(names, plain, lean, exact, strict=True):
        plain_error, lean_error = (a.double() - e).abs().max(), (b.double() - e).abs().max()
        assert lean_error <= 2 * plain_error + 1e-6 * e.abs().max(), (name, lean_error, plain_error)


@pytest.mark.parametrize("tiles", [1, 4])
def test_a_tile_holds_what_tile_tensors_says(tiles):
    """The tiled chain's backward peaks at its floor (input, output gradient, input gradient) plus a tile's share."""
    chain = _chain(32, 32, 32, 32)
    shape = (1, 32, 64, 16)

    def loss(module, batch):
        return (tiled_conv_norm_act_chain(list(module), batch[0], tiles) * batch[1]).sum()  # the gradient: batch[1]

    profile = profile_step(
        chain, (torch.randn(shape, requires_grad=True), torch.randn(shape)), loss_fn=loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0), mode="fake", steps=1,
    )  # fmt: skip
    held, _ = tile_memory(list(chain), shape)
    map_bytes = 32 * 64 * 16 * 4
    backward = profile.phase_breakdowns["backward"]
    transient = backward["activations"] + backward["temporaries"]
    # the input is the batch's; then the output gradient, the input gradient's buffer, the weight gradients summed
    # over the tiles (three 32 × 32 fp32), and one tile's share of what the whole chain would hold
    assert transient <= 2 * map_bytes + 3 * 32 * 32 * 4 + held / tiles + map_bytes / 50
