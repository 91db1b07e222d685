import pytest
import torch
from torch import nn

from lightning_memopt.models import SapiensNormal, ViTBlock, create_model, list_models
from lightning_memopt.models.normal_head import NormalHead

# (embed dim, layers, heads, FFN) and the backbone-alone parameter count (computed column of
# PRESETS.md, in billions).
PUBLISHED = {
    "sapiens_0.3b": ((1024, 24, 16, 4096), 0.307),
    "sapiens_0.6b": ((1280, 32, 16, 5120), 0.636),
    "sapiens_1b": ((1536, 40, 24, 6144), 1.141),
    "sapiens_2b": ((1920, 48, 32, 7680), 2.134),
}


def _count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_backbone_parameter_count_matches_the_computed_column_within_1_percent(name):
    (dim, layers, _, _), billions = PUBLISHED[name]
    with torch.device("meta"):
        net = create_model(name)
    count = _count(net.backbone)
    assert abs(count / 1e9 - billions) / billions < 0.01
    # 12·d² + 13·d per layer, the patch embedding (3·16·16·d + d), the 64 × 64 table, the final norm.
    assert count == layers * (12 * dim**2 + 13 * dim) + (3 * 16 * 16 * dim + dim) + 64 * 64 * dim + 2 * dim
    assert all(p.device.type == "meta" for p in net.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_architecture(name):
    (dim, layers, heads, ffn), _ = PUBLISHED[name]
    with torch.device("meta"):
        net = create_model(name)
    blocks = net.backbone.blocks
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == layers
    assert all(type(block) is ViTBlock for block in blocks)
    block = blocks[0]
    assert (block.attn.num_heads, block.attn.qkv.in_features, block.ffn[0].out_features) == (heads, dim, ffn)
    assert net.image_size == (1024, 768) and net.backbone.patch_size == 16


def test_normal_head_has_three_deconvs_then_1x1_convs_then_dropout_and_a_conv_to_three_channels():
    with torch.device("meta"):
        head = create_model("sapiens_1b").head
    deconvs = [m for m in head.upsample.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [(d.in_channels, d.out_channels) for d in deconvs] == [(1536, 768), (768, 768), (768, 768)]
    assert all((d.kernel_size, d.stride, d.padding, d.bias) == ((4, 4), (2, 2), (1, 1), None) for d in deconvs)
    assert [type(m) for m in head.upsample[0]] == [nn.ConvTranspose2d, nn.InstanceNorm2d, nn.SiLU]
    convs = [m for m in head.refine.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(768, (1, 1))] * 3
    assert (head.predict.in_channels, head.predict.out_channels, head.predict.kernel_size) == (768, 3, (1, 1))
    assert type(head.dropout) is nn.Dropout2d and head.dropout.p == 0.1 and not head.normalize_output


def test_sapiens_2b_maps_1024x768_to_a_512x384_normal_map_on_the_meta_device():
    with torch.device("meta"):
        net = create_model("sapiens_2b")
        features = net.backbone(torch.empty(1, 3, 1024, 768))
        normals = net.head(features)
    assert features.shape == (1, 1920, 64, 48)
    assert normals.shape == (1, 3, 512, 384)


def test_patch_32_quarters_the_tokens_and_the_output():
    with torch.device("meta"):
        net = create_model("sapiens_0.3b", patch_size=32)
        normals = net(torch.empty(1, 3, 1024, 768))
    assert net.backbone.token_grid(1024, 768) == (32, 24)  # 768 tokens instead of 3072
    assert normals.shape == (1, 3, 256, 192)


def test_tiny_variant_gives_raw_normals_and_trains_on_the_cpu():
    torch.manual_seed(0)
    net = create_model("sapiens_tiny")
    assert isinstance(net, SapiensNormal) and net.image_size == (64, 48)
    normals = net(torch.randn(2, 3, 64, 48))
    assert normals.shape == (2, 3, 32, 24)
    assert not torch.allclose(normals.norm(dim=1), torch.ones(2, 32, 24))  # raw, like the official head
    normals[:, 2].sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_normalize_output_keeps_the_unit_normals_of_the_earlier_head():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 64, 48)
    raw = create_model("sapiens_tiny").eval()
    unit = create_model("sapiens_tiny", normalize_output=True).eval()
    unit.load_state_dict(raw.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(unit(images), torch.nn.functional.normalize(raw(images), dim=1))
        torch.testing.assert_close(unit(images).norm(dim=1), torch.ones(2, 32, 24))


def _predict_input(head, features):
    """The input of the head's final conv in one forward, and the refine stages' output it comes from."""
    seen = {}
    hooks = [
        head.refine.register_forward_hook(lambda module, args, output: seen.__setitem__("refined", output)),
        head.predict.register_forward_pre_hook(lambda module, args: seen.__setitem__("predict", args[0])),
    ]
    head(features)
    for hook in hooks:
        hook.remove()
    return seen["predict"], seen["refined"]


def test_head_dropout_zeroes_whole_channels_before_the_final_conv_in_training_only():
    torch.manual_seed(0)
    head = create_model("sapiens_tiny", head_dropout=0.5).head
    features = torch.randn(4, 64, 4, 3)
    predict_input, refined = _predict_input(head.train(), features)
    dropped = predict_input.flatten(2).eq(0).all(dim=2)  # [B, C]: whole channels zeroed
    assert 0 < int(dropped.sum()) < dropped.numel()
    torch.testing.assert_close(predict_input, refined * (~dropped)[..., None, None] * 2.0)  # kept: scaled by 1/(1-p)
    head.eval()
    predict_input, refined = _predict_input(head, features)
    assert torch.equal(predict_input, refined)
    assert torch.equal(head(features), head(features))


def test_head_dropout_zero_is_the_identity_in_training_too():
    head = create_model("sapiens_tiny", head_dropout=0.0).head.train()
    predict_input, refined = _predict_input(head, torch.randn(2, 64, 4, 3))
    assert torch.equal(predict_input, refined)


def test_presets_are_registered_and_take_overrides():
    assert {"sapiens_0.3b", "sapiens_0.6b", "sapiens_1b", "sapiens_2b", "sapiens_tiny"} <= set(list_models())
    net = create_model("sapiens_tiny", attn_impl="math", drop_path_rate=0.1, head_conv_layers=1)
    assert net.backbone.blocks[0].attn.attn_impl == "math"
    assert net.backbone.blocks[-1].drop_path.rate == pytest.approx(0.1)
    assert sum(isinstance(m, nn.Conv2d) for m in net.head.refine.modules()) == 1


def test_head_upscales_8x_and_refuses_empty_channels_and_bad_dropout():
    head = NormalHead(8, deconv_channels=(4, 4, 4), conv_channels=(4,))
    assert head.upscale == 8 and head(torch.randn(1, 8, 2, 3)).shape == (1, 3, 16, 24)
    with pytest.raises(ValueError, match=r"channel counts must be positive.*`deconv_channels`=\[4, 0\]"):
        NormalHead(8, deconv_channels=(4, 0))
    with pytest.raises(ValueError, match=r"`dropout`=1.0 must be in \[0, 1\)"):
        create_model("sapiens_tiny", head_dropout=1.0)


def test_bad_image_size_is_refused():
    with pytest.raises(ValueError, match=r"`image_size`=\(64,\) must be two positive integers"):
        create_model("sapiens_tiny", image_size=(64,))


def test_a_state_dict_on_the_token_grid_loads_into_a_fresh_preset_which_adopts_the_grid():
    torch.manual_seed(0)
    trained = create_model("sapiens_tiny").eval()
    trained.backbone.set_position_grid(trained.backbone.token_grid(*trained.image_size))
    fresh = create_model("sapiens_tiny").eval()
    fresh.load_state_dict(trained.state_dict())  # what resuming a fit that started from an official file does
    assert fresh.backbone.position_grid == (4, 3) == trained.backbone.position_grid
    images = torch.randn(1, 3, 64, 48)
    assert torch.equal(fresh(images), trained(images))
