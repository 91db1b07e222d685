"""The planner's checkpointing regions: one step's calls of each wrapped block and the ops of its forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_memopt.memory import profile_step
from lightning_memopt.planner.estimate import checkpointed_regions
from lightning_memopt.planner.frontier import block_options
from lightning_memopt.planner.hardware import gpu
from lightning_memopt.planner.host import narrow_model


def _anchor(steps: int):
    x = narrow_model("transformer", blocks=2)[1]
    return profile_step(
        lambda: narrow_model("transformer", blocks=2)[0],
        x,
        mode="fake",
        steps=steps,
        loss_fn=lambda module, batch: module(batch).sum(),
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
        blocks=("0", "1"),
    )


@pytest.mark.parametrize("steps", [1, 2])
def test_regions_hold_one_steps_calls_and_the_forward_ops_views_included(steps):
    anchor = _anchor(steps)
    forward = anchor.work(("forward",), ("0",))
    assert forward.ops > forward.kernels  # the block's reshapes, permutes and transposes are ops
    assert anchor.blocks["0"].calls == 1  # per step, as the work: not once more for every step profiled
    regions = checkpointed_regions(anchor, {"0": "full", "1": "offload"})
    assert regions == {"full": (1, forward.ops), "offload": (1, anchor.work(("forward",), ("1",)).ops)}


def test_a_blocks_option_is_priced_per_call_and_per_forward_op():
    anchor = _anchor(1)
    forward = anchor.work(("forward",), ("0",))
    free = replace(gpu("h100_80gb"), region_seconds={})
    priced = replace(free, region_seconds={"full": (1.0, 0.01)})
    cost = {option.mode: option.seconds for option in block_options(anchor, ("0",), priced)["0"]}
    base = {option.mode: option.seconds for option in block_options(anchor, ("0",), free)["0"]}
    assert cost["full"] - base["full"] == pytest.approx(1.0 + 0.01 * forward.ops)
