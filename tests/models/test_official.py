"""Official checkpoints: containers, the IResNet layout, the errors, load_pretrained and the tasks' `pretrained`."""

import numpy as np
import pytest
import torch
from torch import nn

from lightning_memopt.models import OfficialCheckpointError, create_model, load_pretrained
from lightning_memopt.models.official import (
    apply_pretrained,
    convert_official_state_dict,
    official_layout,
    read_official_file,
    to_official_state_dict,
)
from lightning_memopt.models.official.layout import OfficialLayout, Rename, convert_to_official, convert_to_ours
from lightning_memopt.tasks import FaceRecognitionModule


def _seeded_state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Official-layout tensors of preset ``name``: its key names and shapes, seeded values."""
    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.randint(0, 5, value.shape, generator=generator, dtype=value.dtype)
        if not value.is_floating_point()
        else torch.randn(value.shape, generator=generator)
        for key, value in create_model(name).state_dict().items()
    }


# insightface arcface_torch iresnet.py: key names and shapes of r50 (facts file: identical to ours)
INSIGHTFACE_R50 = {
    "conv1.weight": (64, 3, 3, 3),
    "bn1.running_var": (64,),
    "prelu.weight": (64,),
    "layer1.0.bn1.weight": (64,),
    "layer1.0.prelu.weight": (64,),
    "layer1.0.downsample.0.weight": (64, 64, 1, 1),
    "layer2.0.conv2.weight": (128, 128, 3, 3),
    "layer4.2.bn3.bias": (512,),
    "bn2.weight": (512,),
    "fc.weight": (512, 512 * 7 * 7),
    "features.running_mean": (512,),
}


def test_official_iresnet_names_and_shapes_load_as_they_are():
    with torch.device("meta"):
        ours = convert_official_state_dict(create_model("r50").state_dict(), "r50")
    assert {key: tuple(ours[key].shape) for key in INSIGHTFACE_R50} == INSIGHTFACE_R50
    assert len(ours) == 475 and sum(key.startswith("layer3.") for key in ours) == 14 * 18 + 6


@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {"state_dict": sd, "epoch": 3},
        lambda sd: {"model": sd, "optimizer": {"lr": 0.1}},
        lambda sd: {"state_dict": {"module." + key: value for key, value in sd.items()}},
        lambda sd: {"module." + key: value for key, value in sd.items()},
    ],
    ids=["bare", "state_dict", "model", "state_dict+module", "module"],
)
def test_official_containers_load_bitwise_and_round_trip(tmp_path, wrap):
    official = _seeded_state_dict("iresnet_tiny")
    path = tmp_path / "official.pth"
    torch.save(wrap(official), path)
    model = create_model("iresnet_tiny")
    report = load_pretrained(model, path)
    assert report.tensors == len(official) and not report.renamed and not report.not_loaded
    for key, value in model.state_dict().items():
        assert torch.equal(value, official[key]), key
    back = to_official_state_dict(model.state_dict(), "iresnet_tiny")
    assert list(back) == list(official) and all(torch.equal(back[key], official[key]) for key in official)


@pytest.mark.parametrize(
    ("name", "official_key", "our_key"),
    [
        ("iresnet_tiny", "fc.weight", "fc.weight"),
        ("sapiens_tiny", "decode_head.conv_seg.weight", "head.predict.weight"),
        ("cotracker2_tiny", "vis_predictor.0.weight", "visibility_head.weight"),
        ("cotracker3_tiny", "corr_mlp.fc1.weight", "correlation.mlp.0.weight"),
    ],
)
def test_an_unmatched_key_names_both_sides(name, official_key, our_key):
    official = to_official_state_dict(create_model(name).state_dict(), name)
    official["stray." + official_key] = official.pop(official_key)
    with pytest.raises(OfficialCheckpointError) as raised:
        convert_official_state_dict(official, name)
    message = str(raised.value)
    assert f"model tensors with no official counterpart in the file (1): {our_key}" in message
    assert f"official tensors that nothing in the model takes (1): stray.{official_key}" in message


def test_a_shape_mismatch_is_listed_with_both_shapes():
    official = _seeded_state_dict("iresnet_tiny")
    expected = r"shapes differ \(6\): fc.weight \(32, 256\) \(model \(64, 256\)\), fc.bias"
    with pytest.raises(OfficialCheckpointError, match=expected):
        convert_official_state_dict(official, "iresnet_tiny", embedding_size=64)


def test_a_checkpoint_of_another_preset_is_refused_with_the_counts():
    with torch.device("meta"):
        r18 = create_model("r18").state_dict()
    with pytest.raises(OfficialCheckpointError, match=r"with no official counterpart in the file \(\d+\): layer1\.2\."):
        convert_official_state_dict(r18, "r50")


def test_not_strict_loads_what_matches_and_warns_with_every_key(tmp_path):
    official = _seeded_state_dict("iresnet_tiny")
    official["stray.weight"] = official.pop("features.weight")
    torch.save(official, tmp_path / "partial.pth")
    model = create_model("iresnet_tiny")
    before = model.features.weight.clone()
    with pytest.warns(UserWarning, match=r"NOT LOADED \(strict=False\): 2 mismatches: missing features.weight, "):
        report = load_pretrained(model, tmp_path / "partial.pth", strict=False)
    assert report.not_loaded == ["missing features.weight", "unplaced stray.weight"]
    assert torch.equal(model.features.weight, before) and torch.equal(model.fc.weight, official["fc.weight"])


def test_files_without_a_state_dict_or_with_foreign_objects_are_refused(tmp_path):
    torch.save({"epoch": 3, "config": {"lr": 0.1}}, tmp_path / "no_weights.pth")
    with pytest.raises(OfficialCheckpointError, match=r"no state dict found: the file holds 'epoch', 'config'"):
        read_official_file(tmp_path / "no_weights.pth")
    torch.save({"state_dict": _seeded_state_dict("iresnet_tiny"), "meta": Rename("a", "b")}, tmp_path / "pickled.pth")
    with pytest.raises(OfficialCheckpointError, match=r"if you trust the file, load it with `weights_only=False`"):
        read_official_file(tmp_path / "pickled.pth")
    assert len(read_official_file(tmp_path / "pickled.pth", weights_only=False)) == 115
    with pytest.raises(FileNotFoundError, match=r"checkpoint file '.*missing.pth' does not exist"):
        read_official_file(tmp_path / "missing.pth")


def test_models_without_an_official_layout_and_backbone_only_iresnet_are_refused():
    with pytest.raises(OfficialCheckpointError, match=r"no official layout for a Linear; official checkpoints exist"):
        official_layout(nn.Linear(2, 2))
    with pytest.raises(OfficialCheckpointError, match=r"IResNet checkpoints come whole .* load it with `pretrained`"):
        official_layout(create_model("iresnet_tiny"), backbone_only=True)


class _RenamingLayout(OfficialLayout):
    """A made-up layout: ``fc`` is official ``head.1``, and ``body.weight`` is two official halves."""

    family = "made-up"
    rules = (Rename(r"^fc\.", "head.1."),)

    def official_names(self, name, template):
        return ("body.top", "body.bottom") if name == "body.weight" else super().official_names(name, template)

    def official_rows(self, name, template):
        return (1, template.shape[0] - 1)

    def fixed_tensors(self):
        return {"table": torch.arange(4.0)}

    def dropped_reason(self, official_name):
        return "pre-training only" if official_name.startswith("decoder.") else None


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 3, bias=False)
        self.fc = nn.Linear(3, 1)


def test_renames_merged_pieces_fixed_buffers_and_drops_both_ways():
    model = _Tiny()
    layout = _RenamingLayout(model)
    official = convert_to_official(model.state_dict(), layout)
    assert sorted(official) == ["body.bottom", "body.top", "head.1.bias", "head.1.weight", "table"]
    assert official["body.top"].shape == (1, 2) and official["body.bottom"].shape == (2, 2)
    official["decoder.weight"] = torch.zeros(5)
    ours, report = convert_to_ours(official, layout)
    assert all(torch.equal(ours[key], value) for key, value in model.state_dict().items())
    assert report.merged == ["body.weight"] and report.renamed == ["fc.weight", "fc.bias"]
    assert report.checked_fixed == ["table"] and report.dropped == {"decoder.weight": "pre-training only"}
    assert report.summary() == (
        "made-up layout: 3 tensors (2 renamed, 0 reshaped, 1 merged from several); "
        "1 fixed buffers checked (table); dropped 1 (pre-training only)"
    )
    official["table"] = torch.zeros(4)
    expected = r"the official buffer `table` is not what the model computes: its values differ by up to 3 "
    with pytest.raises(OfficialCheckpointError, match=expected):
        convert_to_ours(official, layout)


def test_a_task_starts_from_an_official_file_and_refuses_two(tmp_path):
    official = _seeded_state_dict("iresnet_tiny")
    path = tmp_path / "backbone.pth"
    torch.save({"state_dict": {"module." + key: value for key, value in official.items()}}, path)
    module = FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny", pretrained=str(path))
    assert torch.equal(module.backbone.fc.weight, official["fc.weight"])
    with pytest.raises(OfficialCheckpointError, match=r"give `pretrained`='a' or `pretrained_backbone`='b', not both"):
        apply_pretrained(create_model("iresnet_tiny"), "a", "b")


def test_unreadable_files_directories_and_meta_models_are_refused_with_the_reason(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(OfficialCheckpointError, match=r"notes.txt' is not a checkpoint torch.load reads \(Unsupported"):
        read_official_file(tmp_path / "notes.txt")
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(OfficialCheckpointError, match=r"sharded.ckpt' is a directory \(a sharded checkpoint\?\)"):
        read_official_file(tmp_path / "sharded.ckpt")
    torch.save({"meta": {"seed": np.int64(3)}, "state_dict": _seeded_state_dict("iresnet_tiny")}, tmp_path / "np.pth")
    with pytest.raises(OfficialCheckpointError, match=r"\(Unsupported global: GLOBAL numpy\..*scalar"):
        read_official_file(tmp_path / "np.pth")
    torch.save(_seeded_state_dict("iresnet_tiny"), tmp_path / "official.pth")
    with torch.device("meta"):
        model = create_model("iresnet_tiny")
    with pytest.raises(OfficialCheckpointError, match=r"the model is on the meta device, where loading copies nothing"):
        load_pretrained(model, tmp_path / "official.pth")


def test_a_half_precision_copy_passes_the_buffer_check():
    official = to_official_state_dict(create_model("cotracker2_tiny").state_dict(), "cotracker2_tiny")
    half = {key: value.to(torch.bfloat16) if value.is_floating_point() else value for key, value in official.items()}
    assert len(convert_official_state_dict(half, "cotracker2_tiny")) == len(official) - 2
