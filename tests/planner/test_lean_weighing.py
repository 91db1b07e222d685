"""The planner weighs a block's plain full recomputation against its lean one.

A block with a lean recomputation (the normal head's stages and 1×1 chain) is offered twice to the
checkpointing frontier: ``"full"``, priced plain (one forward again, all of it held again in its
backward), and ``"lean"``, priced as it declares (more work, a piece held again). Where the plain
one meets the budget it is the faster; where only the lean one does, the lean one.
"""

import torch

from lightning_memopt.checkpointing import apply_activation_checkpointing, checkpoint_mode
from lightning_memopt.memory import profile_step
from lightning_memopt.models import create_model
from lightning_memopt.planner import gpu, plan_checkpointing
from lightning_memopt.planner.checkpoint_budget import lean_blocks
from lightning_memopt.planner.frontier import ActivationPeaks, BlockOption, Frontier, block_options
from tests.helpers import fake_activation_peak

HEAD_BLOCKS = ["head.upsample.*", "head.refine"]


def test_the_frontier_takes_plain_where_it_fits_and_lean_where_only_lean_does():
    options = {
        "a": (BlockOption("none", 0, 0.0), BlockOption("full", 60, 1.0), BlockOption("lean", 60, 3.0, held_bytes=6)),
        "b": (BlockOption("none", 0, 0.0), BlockOption("full", 20, 1.0)),  # holds its 20 bytes again
    }
    frontier = Frontier(options, ActivationPeaks(forward=100, backward=100))
    # a peak is max(100 - freed, 100 - freed + the most one block holds again)
    assert frontier.fastest(90) == {"a": "full", "b": "full"}  # 100 - 80 + 60: plain a fits, the faster
    assert frontier.fastest(50) == {"a": "lean"}  # 100 - 60 + 6: only lean a does
    assert frontier.fastest(40) == {"a": "lean", "b": "full"}  # 100 - 80 + 20


def test_only_blocks_cut_in_pieces_get_a_lean_option():
    model = _build()
    blocks = [(name, model.get_submodule(name)) for name in ("head.upsample.0", "head.upsample.2", "head.refine")]
    anchor = profile_step(
        _build, torch.randn(2, 3, 64, 48), loss_fn=_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        mode="fake", steps=1, blocks=tuple(name for name, _ in blocks),
    )  # fmt: skip
    lean = lean_blocks(blocks)
    assert lean == {name: block.lean_recompute() for name, block in blocks}
    options = block_options(anchor, list(lean), gpu("a100_80gb"), lean=lean)
    modes = {name: [option.mode for option in found] for name, found in options.items()}
    # upsample.0 is recomputed in one piece (its lean path is the plain one): no lean option
    assert modes["head.upsample.0"] == ["none", "full", "selective", "offload"]
    assert modes["head.upsample.2"] == modes["head.refine"] == ["none", "full", "selective", "offload", "lean"]
    full, cut = (next(o for o in options["head.refine"] if o.mode == mode) for mode in ("full", "lean"))
    assert cut.freed_bytes == full.freed_bytes and cut.held < full.held and cut.seconds > full.seconds


def _build():
    torch.manual_seed(0)
    return create_model("sapiens_tiny")


def _loss(model, batch):
    return model(batch).square().mean()


def test_a_budget_only_the_lean_chain_meets_plans_it_lean():
    batch = torch.randn(2, 3, 128, 96)
    loose = plan_checkpointing(_build, batch, 0.95, loss_fn=_loss, hardware=gpu("a100_80gb"), blocks=HEAD_BLOCKS)
    assert loose.modes.get("head.refine") != "lean"
    choice = plan_checkpointing(_build, batch, 0.5, loss_fn=_loss, hardware=gpu("a100_80gb"), blocks=HEAD_BLOCKS)
    assert choice.fits and choice.modes == {"head.refine": "lean"}, choice.describe()
    assert choice.policy() == [{"modules": "head.refine", "mode": "lean"}]
    model = _build()
    assert apply_activation_checkpointing(model, choice.policy()) == 1
    assert checkpoint_mode(model.head.refine) == "lean"
    unchecked = fake_activation_peak(_build, batch, _loss)
    lean = fake_activation_peak(_build, batch, _loss, choice.policy())
    plain = fake_activation_peak(_build, batch, _loss, "head.refine")
    # the plain chain holds all of it again in its backward, where the peak is: only the lean one halves it
    assert lean < 0.55 * unchecked < plain
