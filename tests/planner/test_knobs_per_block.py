"""Knobs with a mode per block: checked, described, applied, and carried to memopt-train through Hydra."""

from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from lightning_memopt.checkpointing import checkpoint_mode, checkpoint_modules
from lightning_memopt.models import create_model
from lightning_memopt.planner import Knobs
from lightning_memopt.planner.knobs import train_command

PAIRS = (
    ("backbone.blocks.0", "full"),
    ("head.upsample.1", "selective"),
    ("head.upsample.2", "lean"),
    ("head.refine", "offload"),
)


def test_per_block_knobs_describe_apply_and_round_trip_as_hydra_lists():
    knobs = Knobs("bf16-mixed", checkpoint="per_block", checkpoint_blocks=[list(pair) for pair in PAIRS])
    assert knobs.checkpoint_blocks == PAIRS  # lists (as Hydra gives them) become pairs: equal knobs compare equal
    assert knobs.describe() == "bf16-mixed, per block: full ×1, selective ×1, lean ×1, offload ×1"
    assert Knobs.from_mapping(knobs.as_dict()) == knobs
    model = create_model("sapiens_tiny")
    report = checkpoint_modules(model, knobs.checkpoint_policy())
    assert report.modules == dict(PAIRS)
    assert checkpoint_mode(model.backbone.blocks[1]) is None
    command = train_command(["model=sapiens_tiny"], knobs)
    override = shlex.split(command)[-1]  # as the shell passes it
    parsed = OverridesParser.create().parse_override(override)
    assert Knobs.from_mapping(parsed.value()) == knobs


def test_one_mode_on_every_block_is_that_mode():
    blocks = ["a", "b"]
    assert Knobs().with_block_modes({"a": "offload", "b": "offload"}, blocks) == Knobs(checkpoint="offload")
    assert Knobs().with_block_modes({}, blocks) == Knobs()
    assert Knobs().with_block_modes({"a": "full"}, blocks).checkpoint == "per_block"
    # "lean" is a block's mode, never the checkpoint knob's
    assert Knobs().with_block_modes({"a": "lean", "b": "lean"}, blocks).checkpoint == "per_block"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"checkpoint": "per_block"}, r"`checkpoint_blocks` \(0 given\) go with `checkpoint`='per_block'"),
        ({"checkpoint": "full", "checkpoint_blocks": PAIRS}, r"\(4 given\) go with .* \(got `checkpoint`='full'\)"),
        (
            {"checkpoint": "per_block", "checkpoint_blocks": [("a", "half")]},
            r"unknown mode 'half'; valid choices: full, selective, offload, lean",
        ),
        ({"checkpoint": "per_block", "checkpoint_blocks": [("a",)]}, r"entry \('a',\) must be a \(module name, mode\)"),
        ({"checkpoint": "per_block", "checkpoint_blocks": "a=full"}, r"`checkpoint_blocks`='a=full' must be"),
        ({"checkpoint": "per_block", "checkpoint_blocks": [("", "full")]}, r"module name must be a non-empty string"),
        ({"checkpoint": "sometimes"}, r"Unknown `checkpoint`='sometimes'; valid choices: none, .*, per_block"),
    ],
)
def test_bad_per_block_knobs_are_refused_naming_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        Knobs(**arguments)


def test_block_names_hydra_would_read_as_another_type_come_back_as_names():
    names = ["0", "true", "null", "1e5", "a b", 'x"y', "*.attn", "stage-1"]
    knobs = Knobs(checkpoint="per_block", checkpoint_blocks=[(name, "full") for name in names])
    command = train_command(["model=r100", "data.image_size=[64,48]", "+knobs={precision:fp8}"], knobs)
    arguments = shlex.split(command)[1:]  # as the shell passes them
    assert arguments[:2] == ["model=r100", "data.image_size=[64,48]"] and len(arguments) == 3
    parsed = OverridesParser.create().parse_override(arguments[-1])
    assert Knobs.from_mapping(parsed.value()) == knobs
