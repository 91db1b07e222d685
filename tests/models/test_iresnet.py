import pytest
import torch

from lightning_memopt.models import IBasicBlock, IResNet, create_model

# Backbone parameter counts computed from the published layer shapes (PRESETS.md), in millions.
PUBLISHED_PARAMS_M = {"r18": 24.03, "r34": 34.14, "r50": 43.59, "r100": 65.16, "r200": 118.83}
PUBLISHED_BLOCKS = {
    "r18": (2, 2, 2, 2),
    "r34": (3, 4, 6, 3),
    "r50": (3, 4, 14, 3),
    "r100": (3, 13, 30, 3),
    "r200": (6, 26, 60, 6),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_M))
def test_preset_parameter_count_matches_published_within_half_percent(name):
    with torch.device("meta"):
        net = create_model(name)
    count_m = sum(p.numel() for p in net.parameters()) / 1e6
    assert abs(count_m - PUBLISHED_PARAMS_M[name]) / PUBLISHED_PARAMS_M[name] < 0.005
    assert all(p.device.type == "meta" for p in net.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_BLOCKS))
def test_preset_blocks_per_stage(name):
    with torch.device("meta"):
        net = create_model(name)
    stages = [net.layer1, net.layer2, net.layer3, net.layer4]
    assert tuple(len(stage) for stage in stages) == PUBLISHED_BLOCKS[name]
    for stage, width in zip(stages, (64, 128, 256, 512), strict=True):
        first = stage[0]
        assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
        assert first.downsample[0].kernel_size == (1, 1) and first.downsample[0].stride == (2, 2)
        assert first.conv2.out_channels == width
        assert all(block.downsample is None for block in stage[1:])


def test_r18_feature_maps_halve_from_112_to_7_and_embed_512():
    net = create_model("r18").eval()
    sizes = []
    for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
        stage.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[1:])))
    with torch.no_grad():
        out = net(torch.randn(2, 3, 112, 112))
    assert sizes == [(64, 56, 56), (128, 28, 28), (256, 14, 14), (512, 7, 7)]
    assert out.shape == (2, 512)
    assert net.fc.in_features == 512 * 7 * 7
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1) and net.conv1.bias is None


def test_block_has_no_activation_after_the_residual_add():
    block = IBasicBlock(4, 4).eval()
    x = torch.randn(1, 4, 8, 8)
    residual = block.bn3(block.conv2(block.prelu(block.bn2(block.conv1(block.bn1(x))))))
    torch.testing.assert_close(block(x), residual + x, rtol=0, atol=0)


def test_fp32_head_runs_trunk_in_half_and_head_in_fp32_under_autocast():
    net = create_model("iresnet_tiny").eval()
    trunk_dtypes = []
    net.layer4.register_forward_hook(lambda m, i, o: trunk_dtypes.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(torch.randn(2, 3, 32, 32))
    assert trunk_dtypes == [torch.bfloat16]
    assert out.dtype == torch.float32

    half_head = create_model("iresnet_tiny", fp32_head=False).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert half_head(torch.randn(2, 3, 32, 32)).dtype == torch.bfloat16


def test_embedding_batchnorm_weight_frozen_for_arcface_trainable_for_topofr():
    assert not create_model("iresnet_tiny").features.weight.requires_grad
    assert create_model("iresnet_tiny", freeze_embedding_bn_weight=False).features.weight.requires_grad


def test_dropout_sits_before_the_embedding_linear():
    net = create_model("iresnet_tiny", dropout=0.5)
    assert net.dropout.p == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": (1, 1, 1, 1), "input_size": 100}, r"`input_size`=100 must be a positive multiple of 16"),
        ({"layers": (1, 1, 1)}, r"`layers` and `widths` need one entry per stage"),
        ({"layers": (1, 1, 1, 1), "dropout": 1.0}, r"`dropout`=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IResNet(**kwargs)
