"""Official CoTracker checkpoints (facebookresearch/co-tracker): key names, shapes, fixed tables, both directions."""

import math

import pytest
import torch

from lightning_memopt.models import OfficialCheckpointError, create_model, load_pretrained
from lightning_memopt.models.official import convert_official_state_dict, to_official_state_dict

TINY = ["cotracker2_tiny", "cotracker3_tiny", "cotracker3_offline_tiny"]

# Key names and shapes read from the official modules (CoTracker2, CoTrackerThreeOnline / Offline with the
# published configuration): a few of each kind, and the number of tensors of the official state dicts.
OFFICIAL_V2 = {
    "fnet.conv1.weight": (64, 3, 7, 7),
    "fnet.layer1.0.conv1.weight": (64, 64, 3, 3),
    "fnet.layer2.0.downsample.0.weight": (96, 64, 1, 1),
    "fnet.layer4.1.conv2.bias": (128,),
    "fnet.conv2.weight": (256, 416, 3, 3),
    "fnet.conv3.weight": (128, 256, 1, 1),
    "updateformer.virual_tracks": (1, 64, 1, 384),
    "updateformer.input_transform.weight": (384, 456),
    "updateformer.flow_head.weight": (130, 384),
    "updateformer.time_blocks.5.mlp.fc1.weight": (1536, 384),
    "updateformer.space_virtual_blocks.0.attn.to_kv.weight": (768, 384),
    "updateformer.space_point2virtual_blocks.0.cross_attn.to_q.bias": (384,),
    "updateformer.space_virtual2point_blocks.5.norm_context.weight": (384,),
    "updateformer.space_virtual2point_blocks.5.mlp.fc2.weight": (384, 1536),
    "norm.weight": (128,),
    "track_feat_updater.0.weight": (128, 128),
    "vis_predictor.0.weight": (1, 128),
    "time_emb": (1, 8, 456),
    "pos_emb": (1, 456, 96, 128),
}
OFFICIAL_V3 = {
    "fnet.conv1.weight": (64, 3, 7, 7),
    "fnet.layer3.0.downsample.0.bias": (128,),
    "updateformer.virual_tracks": (1, 64, 1, 384),
    "updateformer.input_transform.weight": (384, 1110),
    "updateformer.flow_head.weight": (2, 384),
    "updateformer.vis_conf_head.weight": (2, 384),
    "updateformer.vis_conf_head.bias": (2,),
    "updateformer.space_point2virtual_blocks.2.cross_attn.to_out.weight": (384, 384),
    "corr_mlp.fc1.weight": (384, 2401),
    "corr_mlp.fc2.weight": (256, 384),
    "time_emb": (1, 16, 1110),
}
PUBLISHED = [
    ("cotracker2", OFFICIAL_V2, 321),
    ("cotracker3", OFFICIAL_V3, 188),
    ("cotracker3_offline", {**OFFICIAL_V3, "time_emb": (1, 60, 1110)}, 188),
]


def _seeded(name, seed=0, **overrides):
    torch.manual_seed(seed)
    return create_model(name, **overrides)


@pytest.mark.parametrize("name", TINY)
def test_official_state_dicts_load_strictly_and_round_trip_bitwise(name):
    model = _seeded(name)
    official = to_official_state_dict(model.state_dict(), name)
    for key in ["fnet.conv1.weight", "fnet.layer2.0.downsample.0.weight", "updateformer.virual_tracks", "time_emb"]:
        assert key in official, key
    assert "updateformer.flow_head.weight" in official
    ours = convert_official_state_dict({"model": official}, name)
    fresh = _seeded(name, seed=1)
    fresh.load_state_dict(ours, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    back = to_official_state_dict(fresh.state_dict(), name)
    assert list(back) == list(official) and all(torch.equal(back[key], official[key]) for key in official)


def test_cotracker3_output_head_is_the_official_flow_head_over_vis_conf_head():
    model = _seeded("cotracker3_tiny")
    official = to_official_state_dict(model.state_dict(), "cotracker3_tiny")
    head = model.updateformer.output_head
    assert torch.equal(official["updateformer.flow_head.weight"], head.weight[:2])
    assert torch.equal(official["updateformer.vis_conf_head.weight"], head.weight[2:])
    assert torch.equal(official["updateformer.vis_conf_head.bias"], head.bias[2:])
    assert torch.equal(official["corr_mlp.fc1.weight"], model.correlation.mlp[0].weight)


@pytest.mark.parametrize(("name", "expected", "count"), PUBLISHED)
def test_published_presets_have_the_official_keys_and_shapes_on_the_meta_device(name, expected, count):
    with torch.device("meta"):
        template = create_model(name).state_dict()
    official = to_official_state_dict(template, name)
    assert len(official) == count
    for key, shape in expected.items():
        assert tuple(official[key].shape) == shape, key
    ours = convert_official_state_dict(official, name)  # the buffers' values are not checked on meta
    assert list(ours) == list(template)
    assert all(ours[key].shape == value.shape for key, value in template.items())


def _official_time_value(frame, channel, dim):
    """The official 1-D table from its formula: sin over the first half of the channels, cos over the second."""
    half = dim // 2
    angle = frame / 10000.0 ** ((channel % half) / half)
    return math.sin(angle) if channel < half else math.cos(angle)


def test_fixed_tables_follow_the_official_formulas():
    official = to_official_state_dict(create_model("cotracker2").state_dict(), "cotracker2")
    time, position = official["time_emb"], official["pos_emb"]
    assert time.dtype == position.dtype == torch.float32
    for frame, channel in [(0, 0), (3, 5), (7, 227), (7, 228), (5, 455)]:
        assert time[0, frame, channel].item() == pytest.approx(_official_time_value(frame, channel, 456), abs=1e-7)
    # pos_emb[:, c, y, x]: the x table over the first 228 channels, the y table over the rest
    for x, y, channel in [(5, 3, 0), (127, 95, 113), (17, 40, 114), (17, 40, 228 + 7), (2, 95, 455)]:
        value = _official_time_value(x, channel, 228) if channel < 228 else _official_time_value(y, channel - 228, 228)
        assert position[0, channel, y, x].item() == pytest.approx(value, abs=1e-6)


def test_a_checkpoint_saved_as_model_dict_loads_through_load_pretrained(tmp_path):
    official = to_official_state_dict(_seeded("cotracker3_tiny").state_dict(), "cotracker3_tiny")
    path = tmp_path / "scaled_online.pth"
    torch.save({"model": official}, path)
    model = _seeded("cotracker3_tiny", seed=1)
    report = load_pretrained(model, path)
    assert report.checked_fixed == ["time_emb"] and not report.not_loaded
    assert "updateformer.output_head.weight" in report.merged
    assert torch.equal(model.updateformer.virtual_tracks, official["updateformer.virual_tracks"])


@pytest.mark.parametrize("name", ["cotracker2_tiny", "cotracker3_tiny"])
def test_a_table_made_for_another_window_is_refused(name):
    official = to_official_state_dict(_seeded(name, window_len=6).state_dict(), name, window_len=6)
    expected = r"official buffer `time_emb` is not what the model computes: its shape \(1, 6, \d+\) is not the model's"
    with pytest.raises(OfficialCheckpointError, match=expected):
        convert_official_state_dict(official, name)  # the preset's window is 4
    assert convert_official_state_dict(official, name, window_len=6).keys() == create_model(name).state_dict().keys()


def test_a_position_table_made_for_another_resolution_is_refused():
    official = to_official_state_dict(create_model("cotracker2_tiny").state_dict(), "cotracker2_tiny")
    official["pos_emb"] = official["pos_emb"] + 1e-3  # same shape, other values
    with pytest.raises(OfficialCheckpointError, match=r"official buffer `pos_emb`"):
        convert_official_state_dict(official, "cotracker2_tiny")
