import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_memopt.checkpointing import Policy, apply_activation_checkpointing, checkpoint_mode, parse_policy
from lightning_memopt.models import create_model
from lightning_memopt.models.iresnet import IBasicBlock
from lightning_memopt.models.vit import ViTBlock
from lightning_memopt.selection import resolve_class


def test_keywords_select_the_preset_blocks_with_their_mode():
    assert [p.describe() for p in parse_policy("preset")] == ["full(auto)"]
    assert [p.describe() for p in parse_policy("selective")] == ["selective(auto)"]
    assert [p.describe() for p in parse_policy("offload")] == ["offload(auto)"]
    assert [p.describe() for p in parse_policy("every_n")] == ["full(auto, every_n=sqrt)"]


def test_classes_dotted_paths_and_globs_are_told_apart():
    (policy,) = parse_policy("lightning_memopt.models.vit.ViTBlock")
    assert policy.modules == (ViTBlock,)
    assert [p.modules for p in parse_policy(["fnet", "updateformer.time_blocks.*", nn.Linear])] == [
        ("fnet",),
        ("updateformer.time_blocks.*",),
        (nn.Linear,),
    ]
    assert parse_policy({"modules": "preset", "mode": "offload"})[0].modules is None


def test_hydra_containers_parse_like_plain_ones():
    spec = OmegaConf.create([{"modules": ["backbone.blocks.*"], "every_n": 2}, "offload"])
    assert [p.describe() for p in parse_policy(spec)] == ["full(backbone.blocks.*, every_n=2)", "offload(auto)"]


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ({"mode": "recompute"}, ValueError, "Unknown `mode`='recompute'; valid choices: full, selective, offload"),
        ({"mode": ["full"]}, ValueError, "Unknown `mode`=['full']; valid choices: full, selective, offload"),
        ({"every_n": 0}, ValueError, "`every_n` must be an integer ≥ 1, 'sqrt' or None, got 0 (int)"),
        ({"every_n": -2}, ValueError, "`every_n` must be an integer ≥ 1, 'sqrt' or None, got -2 (int)"),
        ({"every_n": "half"}, ValueError, "`every_n` must be an integer ≥ 1, 'sqrt' or None, got 'half' (str)"),
        ({"every_n": True}, ValueError, "`every_n` must be an integer ≥ 1, 'sqrt' or None, got True (bool)"),
        ({"every_n": 1.5}, ValueError, "`every_n` must be an integer ≥ 1, 'sqrt' or None, got 1.5 (float)"),
        ({"modules": 7}, ValueError, "`modules` must be module classes, dotted class paths or name globs, got 7 (int)"),
        ({"module": "fnet"}, ValueError, "Unknown policy keys ['module']; valid keys: modules, every_n, mode"),
        ([], ValueError, "`policy` is an empty list"),
        (3, TypeError, "`policy`=3 must be a Policy, a string, a module class"),
        ("torch.nn.Linearr", ValueError, "'torch.nn' has no nn.Module subclass 'Linearr'"),
        ({"modules": [int]}, ValueError, "is not an nn.Module subclass"),
        ({"modules": []}, ValueError, "`modules` is empty"),
    ],
)
def test_bad_policies_raise_naming_the_value_and_the_choices(spec, error, message):
    with pytest.raises(error) as caught:
        parse_policy(spec)
    assert message in str(caught.value)


def test_a_whole_float_every_n_is_an_int_and_a_model_must_be_a_module():
    assert Policy(every_n=2.0).every_n == 2 and isinstance(Policy(every_n=2.0).every_n, int)
    with pytest.raises(TypeError, match=r"`model` must be an nn.Module, got 'r18' \(str\)"):
        apply_activation_checkpointing("r18", "auto")


def test_globs_match_whole_segments_at_the_end_of_a_name():
    tracker = create_model("cotracker2_tiny", time_depth=4, space_depth=2)
    time_blocks = [name for name, _ in Policy("updateformer.time_blocks.*").matches(tracker)]
    assert time_blocks == [f"updateformer.time_blocks.{index}" for index in range(4)]
    assert [name for name, _ in Policy("fnet").matches(tracker)] == ["fnet"]
    assert [name for name, _ in Policy("updateformer.**.mlp").matches(tracker)][:2] == [
        "updateformer.time_blocks.0.mlp",
        "updateformer.time_blocks.1.mlp",
    ]
    assert Policy("time_blocks.*.attn.to_q").matches(tracker)  # a suffix: any prefix may precede it
    assert not Policy("blocks.*").matches(tracker)  # "time_blocks" is not the segment "blocks"


def test_preset_blocks_of_each_family():
    face = create_model("iresnet_tiny")
    assert {type(m) for _, m in Policy().matches(face)} == {IBasicBlock}
    sapiens = create_model("sapiens_tiny")
    assert [name for name, _ in Policy().matches(sapiens)] == [
        "backbone.blocks.0",
        "backbone.blocks.1",
        *(f"head.upsample.{index}" for index in range(3)),
        "head.refine",  # the refine chain is one block: it recomputes in row tiles as a whole
    ]
    tracker = create_model("cotracker3_tiny")
    names = [name for name, _ in Policy().matches(tracker)]
    assert names[:2] == ["fnet", "correlation"] and all(name.startswith("updateformer.") for name in names[2:])
    assert len(names) == 2 + 4  # fnet, correlation, one time block and three space blocks


def test_every_n_keeps_every_nth_sibling_and_sqrt_picks_about_sqrt_l():
    vit = create_model("sapiens_tiny", depth=9)
    every_third = [name for name, _ in Policy("backbone.blocks.*", every_n=3).matches(vit)]
    assert every_third == ["backbone.blocks.0", "backbone.blocks.3", "backbone.blocks.6"]
    assert [name for name, _ in Policy("backbone.blocks.*", every_n="sqrt").matches(vit)] == every_third
    face = create_model("iresnet_tiny")  # one block per stage: each stage is its own run of siblings
    assert len(Policy(IBasicBlock, every_n=2).matches(face)) == 4


def test_every_n_counts_each_class_of_a_container_on_its_own():
    tracker = create_model("cotracker3_tiny")  # fnet and correlation: two classes side by side at the root
    names = [name for name, _ in Policy(every_n=2).matches(tracker)]
    assert names[:2] == ["fnet", "correlation"]


def test_composed_policies_first_match_wins_and_the_rest_is_offloaded():
    vit = create_model("sapiens_tiny", depth=4)
    count = apply_activation_checkpointing(
        vit, [{"modules": ViTBlock, "every_n": 2}, {"modules": ViTBlock, "mode": "offload"}]
    )
    assert count == 4
    assert [checkpoint_mode(block) for block in vit.backbone.blocks] == ["full", "offload", "full", "offload"]


def test_a_policy_that_matches_nothing_lists_what_is_there():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError) as caught:
        apply_activation_checkpointing(model, "head.*")
    message = str(caught.value)
    assert "matches no module" in message
    assert "module classes present: Linear, ReLU, Sequential" in message
    assert "top-level children: 0, 1" in message


def test_a_misspelt_policy_name_is_named_with_the_policy_names():
    with pytest.raises(ValueError) as caught:
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), "selectve")
    message = str(caught.value)
    assert "did you mean the policy 'selective'?" in message
    assert message.endswith("policy names: auto, preset, selective, offload, lean, every_n")


@pytest.mark.parametrize("policy", ["auto", "preset", "selective", "every_n"])
def test_auto_on_a_model_with_nothing_repeated_says_how_to_name_the_blocks(policy):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError) as caught:
        apply_activation_checkpointing(model, policy)
    message = str(caught.value)
    assert "matches no module; no module declares its blocks" in message
    assert "top-level children: 0 (Linear), 1 (ReLU)" in message
    assert "a module class, a dotted class path or a name glob" in message


def test_resolve_class_imports_module_classes_only():
    assert resolve_class("torch.nn.Conv2d") is nn.Conv2d
    with pytest.raises(ValueError, match="no nn.Module subclass 'tensor'"):
        resolve_class("torch.tensor")
    with pytest.raises(ModuleNotFoundError):
        resolve_class("no_such_package.Block")
    assert torch.nn.Linear in {p.modules[0] for p in parse_policy("torch.nn.Linear")}
