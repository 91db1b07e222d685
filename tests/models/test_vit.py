import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memopt.models import VisionTransformer, ViTBlock
from lightning_memopt.models.vit import Attention, DropPath, resize_position_table


def _vit(**kwargs):
    options = dict(embed_dim=32, depth=2, num_heads=4, ffn_dim=64, position_grid=(4, 4))
    options.update(kwargs)
    return VisionTransformer(**options)


class _RecordShapes(TorchDispatchMode):
    """Record the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize(("patch_size", "grid"), [(16, (64, 48)), (32, (32, 24)), (8, (128, 96))])
def test_token_grid_at_1024x768_shrinks_with_a_larger_patch(patch_size, grid):
    with torch.device("meta"):
        vit = _vit(patch_size=patch_size)
        features = vit(torch.empty(1, 3, 1024, 768))
    assert vit.token_grid(1024, 768) == grid
    assert features.shape == (1, 32, *grid)


def test_patch_embedding_is_a_strided_conv_with_padding_2_and_no_class_token():
    vit = _vit()
    conv = vit.patch_embed
    assert (conv.kernel_size, conv.stride, conv.padding) == ((16, 16), (16, 16), (2, 2))
    assert conv.bias is not None
    assert {name for name, _ in vit.named_parameters() if "." not in name} == {"pos_embed"}
    assert vit.pos_embed.shape == (1, 16, 32)


def test_position_table_is_resized_bicubically_with_clamped_borders():
    # A table whose value is the column index 0..3 of a 1 x 4 grid, halved to 1 x 2 columns: the
    # samples sit at 0.5 and 2.5, with cubic weights (-3/32, 19/32, 19/32, -3/32) on clamped columns.
    table = torch.arange(4.0).view(1, 4, 1)
    resized = resize_position_table(table, (1, 4), (1, 2))
    torch.testing.assert_close(resized.flatten(), torch.tensor([0.40625, 2.59375]))
    assert resize_position_table(table, (1, 4), (1, 4)) is table


def test_a_model_with_the_64x64_pretraining_table_runs_on_a_tiny_input():
    vit = _vit(position_grid=(64, 64))
    assert vit(torch.randn(2, 3, 64, 48)).shape == (2, 32, 4, 3)


def test_set_position_grid_resizes_the_table_once_and_the_forward_is_unchanged():
    torch.manual_seed(0)
    vit = _vit().eval()
    images = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        before = vit(images)
    table = vit.pos_embed.detach().clone()
    vit.pos_embed.requires_grad_(False)
    vit.set_position_grid(vit.token_grid(64, 48))
    assert vit.position_grid == (4, 3) and vit.pos_embed.shape == (1, 12, 32)
    assert isinstance(vit.pos_embed, torch.nn.Parameter) and not vit.pos_embed.requires_grad
    assert torch.equal(vit.pos_embed, resize_position_table(table, (4, 4), (4, 3)))
    assert vit.pos_embed.is_contiguous() and vit.state_dict()["pos_embed"].shape == (1, 12, 32)
    with torch.no_grad():
        assert torch.equal(vit(images), before)  # the same table, resized once instead of at every forward


def test_set_position_grid_keeps_the_dtype_and_ignores_the_current_grid():
    vit = _vit().to(torch.float64)
    parameter = vit.pos_embed
    vit.set_position_grid((4, 4))
    assert vit.pos_embed is parameter
    vit.set_position_grid((2, 5))
    assert vit.pos_embed.dtype == torch.float64 and vit.pos_embed.requires_grad and vit.position_grid == (2, 5)
    with pytest.raises(ValueError, match=r"`grid`=\(0, 3\) must be two positive integers"):
        vit.set_position_grid((0, 3))


def test_set_position_grid_works_on_the_meta_device():
    with torch.device("meta"):
        vit = _vit(position_grid=(64, 64))
    vit.set_position_grid((64, 48))
    assert vit.pos_embed.device.type == "meta" and vit.pos_embed.shape == (1, 3072, 32)


def test_forward_adds_the_resized_table_and_ends_with_the_final_norm():
    vit = _vit().eval()
    images = torch.randn(1, 3, 64, 48)
    tokens = vit.patch_embed(images).flatten(2).transpose(1, 2)
    tokens = tokens + resize_position_table(vit.pos_embed, (4, 4), (4, 3))
    for block in vit.blocks:
        tokens = block(tokens)
    expected = vit.norm(tokens).transpose(1, 2).reshape(1, 32, 4, 3)
    with torch.no_grad():
        torch.testing.assert_close(vit(images), expected)
    assert vit.norm.eps == 1e-6 and all(block.norm1.eps == 1e-6 for block in vit.blocks)


def test_blocks_are_pre_norm_with_qkv_bias():
    block = ViTBlock(dim=16, num_heads=2, ffn_dim=32).eval()
    x = torch.randn(1, 5, 16)
    after_attention = x + block.attn(block.norm1(x))
    expected = after_attention + block.ffn(block.norm2(after_attention))
    torch.testing.assert_close(block(x), expected)
    assert block.attn.qkv.bias is not None and block.attn.qkv.out_features == 48


def test_sdpa_and_math_attention_agree_in_outputs_and_gradients():
    torch.manual_seed(0)
    vit = _vit(depth=3)
    images = torch.randn(2, 3, 64, 48)
    results = {}
    for impl in ("sdpa", "math"):
        for module in vit.modules():
            if isinstance(module, Attention):
                module.attn_impl = impl
        vit.zero_grad()
        out = vit(images)
        out.square().sum().backward()
        results[impl] = (out.detach(), vit.blocks[0].attn.qkv.weight.grad.clone())
    torch.testing.assert_close(results["sdpa"][0], results["math"][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(results["sdpa"][1], results["math"][1], rtol=1e-4, atol=1e-5)


def test_only_math_attention_materialises_the_tokens_by_tokens_matrix():
    tokens = torch.randn(1, 12, 16)
    for impl, materialised in (("sdpa", False), ("math", True)):
        with _RecordShapes() as record:
            Attention(16, num_heads=2, attn_impl=impl)(tokens)
        assert ((1, 2, 12, 12) in record.shapes) is materialised


def test_unknown_attn_impl_lists_the_choices():
    with pytest.raises(ValueError, match=r"Unknown `attn_impl`='flash'; valid choices: sdpa, math"):
        _vit(attn_impl="flash")


def test_drop_path_rate_rises_linearly_over_depth():
    vit = _vit(depth=5, drop_path_rate=0.2)
    assert [block.drop_path.rate for block in vit.blocks] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])


def test_drop_path_drops_whole_samples_and_rescales_the_kept_ones():
    torch.manual_seed(0)
    out = DropPath(0.5).train()(torch.ones(2000, 3))
    assert set(out.unique().tolist()) == {0.0, 2.0}
    assert torch.all(out == out[:, :1])  # a sample is dropped whole
    assert 0.45 < (out[:, 0] == 0).float().mean() < 0.55


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"embed_dim": 30, "num_heads": 4}, r"`embed_dim`=30 must be divisible by `num_heads`=4"),
        ({"drop_path_rate": 1.0}, r"`drop_path_rate`=1.0 must be in \[0, 1\)"),
        ({"depth": 0}, r"`depth`=0 must be a positive integer"),
        ({"position_grid": (4,)}, r"`position_grid`=\(4,\) must be two positive integers"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _vit(**kwargs)


def test_layer_ids_count_blocks_from_one():
    vit = _vit(depth=3)
    ids = {name: vit.layer_id(name) for name, _ in vit.named_parameters()}
    assert ids["pos_embed"] == ids["patch_embed.weight"] == 0
    assert [ids[f"blocks.{i}.attn.qkv.weight"] for i in range(3)] == [1, 2, 3]
    assert ids["norm.weight"] == 4
