"""Declared memory structure and block discovery: presets and models that are not ours."""

import pytest
import torch
from torch import nn

from lightning_memopt.models import create_model
from lightning_memopt.models.discovery import discover_blocks
from lightning_memopt.models.structure import (
    AttentionSwitch,
    MemoryStructure,
    attention_kernels,
    model_structure,
    set_attention,
)
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule
from tests.foreign_models import StagedCNN, TinyViT, TwoTower, Unrepeated


def _classes(found):
    return [type(module).__name__ for _, module in found]


@pytest.mark.parametrize(
    ("name", "classes"),
    [
        ("r18", ["IBasicBlock"] * 8),
        ("sapiens_tiny", ["ViTBlock"] * 2 + ["ConvNormAct"] * 3 + ["ConvNormActChain"]),
        ("cotracker2_tiny", ["BasicEncoder", "FullCorrelation"] + ["AttentionBlock"] * 4),
        ("cotracker3_tiny", ["BasicEncoder", "LocalCorrelation"] + ["AttentionBlock"] * 4),
    ],
)
def test_every_preset_declares_its_blocks(name, classes):
    structure = model_structure(create_model(name))
    assert sorted(_classes(structure.blocks)) == sorted(classes)
    assert structure.discovered == [] and structure.source == "declared"


def test_the_tasks_collect_the_declarations_of_their_parts():
    face = model_structure(FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny"))
    assert face.block_names == ["backbone.layer1.0", "backbone.layer2.0", "backbone.layer3.0", "backbone.layer4.0"]
    assert face.island_names == ["head"]  # the Partial FC margin head
    normals = model_structure(NormalEstimationModule(backbone="sapiens_tiny"))
    assert normals.island_names == ["network.head.predict"]
    attention = ["network.backbone.blocks.0.attn", "network.backbone.blocks.1.attn"]
    assert [name for name, _ in normals.attention] == attention


@pytest.mark.parametrize(
    ("model", "names"),
    [
        (TinyViT, [f"encoder.layers.{i}" for i in range(4)]),
        (
            StagedCNN,
            ["stages.0.blocks.0", "stages.0.blocks.1", *(f"stages.1.blocks.{i}" for i in range(3))]
            + ["stages.2.blocks.0", "stages.2.blocks.1"],
        ),
        (TwoTower, [f"towers.image.2.layers.{i}" for i in range(3)] + [f"towers.text.1.layers.{i}" for i in range(2)]),
        (Unrepeated, []),
    ],
)
def test_discovery_finds_the_repeated_blocks_of_foreign_models(model, names):
    structure = model_structure(model())
    assert structure.block_names == names
    assert structure.discovered == names


def test_discovery_alone_finds_the_blocks_the_presets_declare():
    for name in ("r18", "r50"):
        model = create_model(name)
        assert [n for n, _ in discover_blocks(model)] == model_structure(model).block_names, name
    # the normal head declares its 1×1 stages as one block (recomputed over tiles); discovery finds them one by one
    model = create_model("sapiens_tiny")
    declared = model_structure(model).block_names
    assert declared[-1] == "head.refine"
    refine = [f"head.refine.{index}" for index in range(len(model.head.refine))]
    assert [n for n, _ in discover_blocks(model)] == declared[:-1] + refine


def test_a_cnn_whose_stages_hold_a_single_block_keeps_the_stages():
    # iresnet_tiny has one block per stage: layer1 … layer4 are the repeated units
    assert [name for name, _ in discover_blocks(create_model("iresnet_tiny"))] == [f"layer{i}" for i in range(1, 5)]


def test_plain_sequential_parts_are_not_a_run_but_a_numbered_series_is():
    model = nn.Module()
    model.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model.decoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert discover_blocks(model) == []
    model.stage1 = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model.stage2 = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert [name for name, _ in discover_blocks(model)] == ["stage1", "stage2"]


def test_single_layers_and_parameterless_modules_are_never_blocks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.ReLU()), nn.Sequential(nn.ReLU()))
    assert discover_blocks(model) == []


def test_declarations_own_their_subtree_and_nested_blocks_keep_the_outermost():
    class Declares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyViT(depth=3)

        def memory_structure(self) -> MemoryStructure:
            return MemoryStructure(blocks=[self.net.encoder.layers[0], self.net.encoder.layers[0].mlp])

    model = nn.Module()
    model.declared = Declares()
    model.other = TinyViT(depth=2)
    structure = model_structure(model)
    assert structure.block_names == [
        "declared.net.encoder.layers.0",
        "other.encoder.layers.0",
        "other.encoder.layers.1",
    ]
    assert structure.discovered == ["other.encoder.layers.0", "other.encoder.layers.1"]
    assert structure.source == "1 declared, 2 discovered"


def test_declaring_no_blocks_stops_discovery_but_islands_alone_do_not():
    class NoBlocks(TinyViT):
        def memory_structure(self) -> MemoryStructure:
            return MemoryStructure(blocks=(), fp32_islands=[self.classifier])

    class IslandsOnly(TinyViT):
        def memory_structure(self) -> MemoryStructure:
            return MemoryStructure(fp32_islands=[self.classifier])

    assert model_structure(NoBlocks()).blocks == []
    assert model_structure(NoBlocks()).island_names == ["classifier"]
    assert len(model_structure(IslandsOnly()).blocks) == 4


def test_a_declared_module_outside_the_model_is_named():
    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def memory_structure(self) -> MemoryStructure:
            return MemoryStructure(blocks=[nn.Linear(2, 2)])

    with pytest.raises(ValueError, match=r"module '\(root\)' declares in `blocks` a Linear that is not one of"):
        model_structure(Wrong())


def test_attention_switches_set_and_restore_every_declared_kernel():
    model = create_model("cotracker2_tiny")
    before = attention_kernels(model)
    assert len(before) == 4 and set(before.values()) == {"sdpa"}
    assert set_attention(model, "math") == 4
    assert set(attention_kernels(model).values()) == {"math"}
    assert set_attention(model, before) == 4 and attention_kernels(model) == before
    assert set_attention(TinyViT(), "math") == 0  # declares nothing: left alone
    with pytest.raises(ValueError, match=r"Unknown `attn_impl`='flash'; valid choices: sdpa, math"):
        set_attention(model, "flash")


def test_a_declared_attention_switch_changes_the_computation():
    holder = create_model("sapiens_tiny", depth=1).eval()  # the head's dropout would differ between the calls
    switch = AttentionSwitch(holder.backbone.blocks[0].attn)
    images = torch.randn(1, 3, 64, 48)
    fused = holder(images)
    switch.set("math")
    assert switch.get() == "math"
    torch.testing.assert_close(holder(images), fused, rtol=1e-5, atol=1e-5)
