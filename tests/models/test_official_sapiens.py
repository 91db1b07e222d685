"""Official Sapiens checkpoints: fine-tuned normal models and MAE backbones, in and out of our presets."""

import pytest
import torch
import torch.nn.functional as F

from lightning_memopt.models import OfficialCheckpointError, create_model, load_pretrained
from lightning_memopt.models import official as official_module
from lightning_memopt.models import vit as vit_module
from lightning_memopt.models.official import (
    convert_official_state_dict,
    official_layout,
    to_official_state_dict,
)
from lightning_memopt.models.official.layout import convert_to_ours

# (embed dim, layers, FFN) of the presets; the head is 768 wide in all of them.
PRESETS = {
    "sapiens_0.3b": (1024, 24, 4096),
    "sapiens_0.6b": (1280, 32, 5120),
    "sapiens_1b": (1536, 40, 6144),
    "sapiens_2b": (1920, 48, 7680),
}
# sapiens_tiny: width 64, 2 layers, FFN 256, head 32; 64 × 48 images → a 4 × 3 token grid; its own grid 4 × 4.
TINY = (64, 2, 256)
TINY_HEAD = 32
TINY_TOKENS = (4, 3)


def _official_shapes(dim, depth, ffn, head=768, rows=3072):
    """Key names and shapes of an official fine-tuned normal model (mmpretrain ViT + mmseg VitNormalHead)."""
    shapes = {
        "backbone.pos_embed": (1, rows, dim),
        "backbone.patch_embed.projection.weight": (dim, 3, 16, 16),
        "backbone.patch_embed.projection.bias": (dim,),
    }
    for i in range(depth):
        layer = f"backbone.layers.{i}."
        for norm in ("ln1", "ln2"):
            shapes[layer + norm + ".weight"] = shapes[layer + norm + ".bias"] = (dim,)
        shapes[layer + "attn.qkv.weight"], shapes[layer + "attn.qkv.bias"] = (3 * dim, dim), (3 * dim,)
        shapes[layer + "attn.proj.weight"], shapes[layer + "attn.proj.bias"] = (dim, dim), (dim,)
        shapes[layer + "ffn.layers.0.0.weight"], shapes[layer + "ffn.layers.0.0.bias"] = (ffn, dim), (ffn,)
        shapes[layer + "ffn.layers.1.weight"], shapes[layer + "ffn.layers.1.bias"] = (dim, ffn), (dim,)
    shapes["backbone.ln1.weight"] = shapes["backbone.ln1.bias"] = (dim,)
    for stage, source in enumerate((dim, head, head)):
        shapes[f"decode_head.deconv_layers.{3 * stage}.weight"] = (source, head, 4, 4)
    for stage in range(3):
        shapes[f"decode_head.conv_layers.{3 * stage}.weight"] = (head, head, 1, 1)
        shapes[f"decode_head.conv_layers.{3 * stage}.bias"] = (head,)
    shapes["decode_head.conv_seg.weight"], shapes["decode_head.conv_seg.bias"] = (3, head, 1, 1), (3,)
    return shapes


def _seeded(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}


def _tiny_official(seed=0):
    return _seeded(_official_shapes(*TINY, head=TINY_HEAD, rows=TINY_TOKENS[0] * TINY_TOKENS[1]), seed)


def _mae_backbone(prefix, seed=1):
    """An MAE pre-training backbone of sapiens_tiny: class token, 1 + 4·4 table rows, no head."""
    dim = TINY[0]
    backbone = {
        key: value for key, value in _official_shapes(*TINY, head=TINY_HEAD).items() if key.startswith("backbone.")
    }
    backbone["backbone.pos_embed"] = (1, 1 + 4 * 4, dim)
    backbone["backbone.cls_token"] = (1, 1, dim)
    return {prefix + key.removeprefix("backbone."): value for key, value in _seeded(backbone, seed).items()}


def _bicubic(table, source, target):
    """The table resized the way the reference resizes it at load: bicubic, align_corners=False."""
    grid = table.reshape(1, *source, -1).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=target, mode="bicubic", align_corners=False).flatten(2).transpose(1, 2)


def test_sapiens_0_3b_exports_the_literal_official_names_and_shapes_on_meta():
    with torch.device("meta"):
        ours = create_model("sapiens_0.3b").state_dict()
    official = to_official_state_dict(ours, "sapiens_0.3b")
    expected = {
        "backbone.layers.0.ln1.weight": (1024,),
        "backbone.layers.0.ffn.layers.0.0.weight": (4096, 1024),
        "backbone.layers.23.ffn.layers.1.weight": (1024, 4096),
        "backbone.layers.0.attn.qkv.weight": (3072, 1024),
        "backbone.ln1.weight": (1024,),
        "backbone.patch_embed.projection.weight": (1024, 3, 16, 16),
        "backbone.pos_embed": (1, 3072, 1024),
        "decode_head.deconv_layers.0.weight": (1024, 768, 4, 4),
        "decode_head.conv_layers.6.weight": (768, 768, 1, 1),
        "decode_head.conv_seg.weight": (3, 768, 1, 1),
    }
    assert {key: tuple(official[key].shape) for key in expected} == expected
    assert ours["backbone.pos_embed"].shape == (1, 4096, 1024)  # our preset keeps the 64 × 64 pre-training grid


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_converts_both_ways_on_meta(name):
    shapes = _official_shapes(*PRESETS[name])
    official = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    ours = convert_official_state_dict(official, name)
    assert len(ours) == len(official) and ours["backbone.pos_embed"].shape[1] == 64 * 48
    back = to_official_state_dict(ours, name)
    assert {key: tuple(value.shape) for key, value in back.items()} == shapes


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {"state_dict": sd, "meta": {"epoch": 3}},
        lambda sd: {"state_dict": {"module." + key: value for key, value in sd.items()}},
    ],
    ids=["bare", "state_dict", "state_dict+module"],
)
def test_a_fine_tuned_file_loads_strictly_and_the_model_adopts_its_grid(tmp_path, monkeypatch, wrap):
    official = _tiny_official()
    path = tmp_path / "sapiens_normal.pth"
    torch.save(wrap(official), path)
    model = create_model("sapiens_tiny")
    assert model.backbone.position_grid == (4, 4)
    messages = []
    monkeypatch.setattr(official_module, "rank_zero_info", messages.append)
    report = load_pretrained(model, path)
    assert report.tensors == len(official) and not report.dropped and not report.not_loaded
    assert messages[0].endswith("39 renamed, 0 reshaped); position table 4×3 (the checkpoint's grid)")
    assert model.backbone.position_grid == TINY_TOKENS
    pairs = {
        "backbone.pos_embed": model.backbone.pos_embed,
        "backbone.patch_embed.projection.weight": model.backbone.patch_embed.weight,
        "backbone.layers.1.ln2.bias": model.backbone.blocks[1].norm2.bias,
        "backbone.layers.1.attn.qkv.weight": model.backbone.blocks[1].attn.qkv.weight,
        "backbone.layers.0.ffn.layers.0.0.weight": model.backbone.blocks[0].ffn[0].weight,
        "backbone.layers.0.ffn.layers.1.bias": model.backbone.blocks[0].ffn[2].bias,
        "backbone.ln1.weight": model.backbone.norm.weight,
        "decode_head.deconv_layers.3.weight": model.head.upsample[1][0].weight,
        "decode_head.conv_layers.6.bias": model.head.refine[2][0].bias,
        "decode_head.conv_seg.weight": model.head.predict.weight,
    }
    for key, parameter in pairs.items():
        assert torch.equal(parameter, official[key]), key


def test_the_loaded_model_adds_its_table_without_any_resize(tmp_path, monkeypatch):
    path = tmp_path / "sapiens_normal.pth"
    torch.save(_tiny_official(), path)
    model = create_model("sapiens_tiny").eval()
    load_pretrained(model, path)
    calls = []

    def recording_resize(table, source_grid, target_grid):
        calls.append((tuple(source_grid), tuple(target_grid)))
        return resize_position_table(table, source_grid, target_grid)

    resize_position_table = vit_module.resize_position_table
    monkeypatch.setattr(vit_module, "resize_position_table", recording_resize)
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 48))
    assert calls == [(TINY_TOKENS, TINY_TOKENS)]  # the identity: the table is added as it is


def test_official_to_ours_to_official_is_bitwise():
    official = _tiny_official(seed=3)
    ours = convert_official_state_dict({"state_dict": official}, "sapiens_tiny")
    back = to_official_state_dict(ours, "sapiens_tiny")
    assert back.keys() == official.keys()
    assert all(torch.equal(back[key], official[key]) for key in official)


def test_export_puts_our_table_on_the_token_grid():
    model = create_model("sapiens_tiny")
    official = to_official_state_dict(model.state_dict(), "sapiens_tiny")
    table = model.backbone.pos_embed.detach()
    torch.testing.assert_close(official["backbone.pos_embed"], _bicubic(table, (4, 4), TINY_TOKENS))
    assert torch.equal(official["decode_head.conv_seg.weight"], model.head.predict.weight)


@pytest.mark.parametrize("prefix", ["", "backbone."], ids=["bare MAEViT", "mmpretrain MAE"])
def test_an_mae_backbone_loads_with_its_class_row_dropped_and_its_grid_resized(tmp_path, prefix):
    mae = _mae_backbone(prefix)
    if prefix:  # a whole MAE training checkpoint also holds its decoder
        mae |= {"neck.mask_token": torch.zeros(1, 1, 16), "neck.decoder_norm.weight": torch.ones(16)}
    path = tmp_path / "sapiens_mae.pth"
    torch.save({"state_dict": mae}, path)
    model = create_model("sapiens_tiny")
    head = {key: value.clone() for key, value in model.head.state_dict().items()}
    report = load_pretrained(model, path, backbone_only=True)
    table = mae[prefix + "pos_embed"]
    assert model.backbone.position_grid == TINY_TOKENS
    assert torch.equal(model.backbone.pos_embed.detach(), _bicubic(table[:, 1:], (4, 4), TINY_TOKENS))
    assert torch.equal(model.backbone.blocks[1].ffn[2].weight, mae[prefix + "layers.1.ffn.layers.1.weight"])
    assert all(torch.equal(value, head[key]) for key, value in model.head.state_dict().items())
    assert report.reshaped == ["backbone.pos_embed"]
    assert report.dropped["backbone.cls_token"].startswith("class token")
    assert {key for key, reason in report.dropped.items() if reason == "MAE pre-training decoder"} == (
        {"neck.mask_token", "neck.decoder_norm.weight"} if prefix else set()
    )
    assert "dropped 1 (class token" in report.summary()


def test_a_full_size_mae_table_is_resized_to_the_64x48_token_grid_on_meta():
    with torch.device("meta"):
        model = create_model("sapiens_0.3b")
    backbone = {
        key: torch.empty(shape, device="meta")
        for key, shape in _official_shapes(*PRESETS["sapiens_0.3b"]).items()
        if key.startswith("backbone.")
    }
    backbone["backbone.pos_embed"] = torch.empty(1, 1 + 64 * 64, 1024, device="meta")
    backbone["backbone.cls_token"] = torch.empty(1, 1, 1024, device="meta")
    ours, report = convert_to_ours(backbone, official_layout(model, backbone_only=True))
    assert ours["backbone.pos_embed"].shape == (1, 3072, 1024) and not any(key.startswith("head.") for key in ours)
    assert list(report.dropped) == ["backbone.cls_token"]


def test_a_table_on_another_grid_is_an_error_naming_the_grids():
    official = _tiny_official()
    official["backbone.pos_embed"] = torch.zeros(1, 20, TINY[0])
    expected = r"its 20 rows fit neither the token grid 4×3 .* \(12 rows\) nor the model's position grid 4×4 \(16 "
    with pytest.raises(OfficialCheckpointError, match=expected):
        convert_official_state_dict(official, "sapiens_tiny")
    ours = create_model("sapiens_tiny").state_dict()
    ours["backbone.pos_embed"] = torch.zeros(1, 20, TINY[0])
    with pytest.raises(OfficialCheckpointError, match="of our state dict: its 20 rows"):
        to_official_state_dict(ours, "sapiens_tiny")


def test_a_table_on_the_models_own_grid_loads_as_it_is():
    official = _tiny_official()
    official["backbone.pos_embed"] = torch.randn(1, 16, TINY[0])
    model = create_model("sapiens_tiny")
    model.load_state_dict(convert_official_state_dict(official, "sapiens_tiny"))
    assert model.backbone.position_grid == (4, 4)
    assert torch.equal(model.backbone.pos_embed, official["backbone.pos_embed"])
