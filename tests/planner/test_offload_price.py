"""Offload's price on a GPU: the copy schedule on seconds, the step it prices, and the blocks a GPU plan offloads."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn import functional as F

from lightning_memopt.checkpointing.policy import Policy
from lightning_memopt.memory import profile_step
from lightning_memopt.memory.work import Work
from lightning_memopt.planner import gpu, plan_checkpointing, step_cost
from lightning_memopt.planner.cost import unhidden_offloads
from lightning_memopt.planner.estimate import checkpointed
from lightning_memopt.planner.frontier import ActivationPeaks, BlockOption, Frontier
from lightning_memopt.planner.offload_price import BlockSeconds, OffloadedBlock, copy_waits, unhidden_seconds
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule
from lightning_memopt.vocabulary import GB


def test_a_block_comes_back_from_the_first_unpack_of_the_next_offloaded_one():
    kept = BlockSeconds(1.0, 2.0)
    blocks = [BlockSeconds(1.0, 2.0, copy=3.0), kept, BlockSeconds(1.0, 2.0, copy=1.0), kept]
    # out: the first 1 → 4, the third 4 → 5 (queued behind it); backward: the last block 4 → 6, then the third
    # block's first unpack brings it back (6 → 7: waited for) and the first one behind it (7 → 10), which the
    # third and second blocks' backward (7 → 11) hide
    assert copy_waits(blocks) == [0.0, 0.0, 1.0, 0.0]
    assert copy_waits([kept, kept]) == [0.0, 0.0]
    assert copy_waits([]) == []


def _random_blocks(rng: random.Random) -> list[BlockSeconds]:
    return [
        BlockSeconds(rng.uniform(0.1, 2.0), rng.uniform(0.1, 4.0), rng.choice([0.0, rng.uniform(0.0, 5.0)]))
        for _ in range(rng.randint(1, 12))
    ]


def test_the_step_is_never_shorter_than_its_bytes_through_the_link():
    rng = random.Random(0)
    for _ in range(500):
        blocks = _random_blocks(rng)
        waits = copy_waits(blocks)
        step = sum(block.forward + block.backward for block in blocks) + sum(waits)
        assert min(waits) >= 0.0 and step >= sum(block.copy for block in blocks) - 1e-9


def test_offloading_only_hidden_blocks_waits_only_for_the_last_ones_way_back():
    rng = random.Random(1)
    checked = 0
    for _ in range(500):
        every = [BlockSeconds(b.forward, b.backward, rng.uniform(0.01, 2.0)) for b in _random_blocks(rng)]
        hidden = [unhidden == 0.0 for unhidden in unhidden_seconds(every)]
        chosen = [index for index, hides in enumerate(hidden) if hides and rng.random() < 0.7]
        if not chosen:
            continue
        blocks = [block if index in chosen else BlockSeconds(block.forward, block.backward) for index, block in
                  enumerate(every)]  # fmt: skip
        expected = [every[index].copy if index == chosen[-1] else 0.0 for index in range(len(every))]
        assert copy_waits(blocks) == pytest.approx(expected)
        checked += 1
    assert checked > 100


def test_a_step_cost_waits_for_what_its_compute_cannot_hide():
    h200 = gpu("h200_141gb")
    second = Work(half_flops=989e12 * 0.45)  # one second of bf16 arithmetic
    block = OffloadedBlock(second, second.scaled(2), offloaded_bytes=25e9)  # half a second each way
    copies = [block, block, OffloadedBlock(second, second.scaled(2))]
    step = second.scaled(9)
    priced = step_cost(step, Work(), h200, offloaded_bytes=50e9, copies=copies)
    assert priced.offload == pytest.approx(1.0) and priced.offload_wait == pytest.approx(0.5)  # the last one's way back
    assert priced.total == pytest.approx(9.5) and priced.bound == "device"
    unscheduled = step_cost(step, Work(), h200, offloaded_bytes=50e9)
    assert unscheduled.offload_wait == pytest.approx(2.0) and unscheduled.total == pytest.approx(11.0)  # out and back
    linked = step_cost(Work(), Work(), h200, offloaded_bytes=50e9, copies=copies)  # no compute to hide anything
    assert linked.total >= 50e9 / (h200.host_link_gbps * GB) and linked.bound == "host link"


def _r100() -> tuple:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(128, 3, 112, 112, generator=generator)
    return (lambda: FaceRecognitionModule(num_classes=1000, backbone="r100")), (
        images,
        torch.randint(0, 1000, (128,), generator=generator),
    )


def _sapiens() -> tuple:
    generator = torch.Generator().manual_seed(0)
    batch = {
        "image": torch.randn(2, 3, 1024, 768, generator=generator),
        "normal": F.normalize(torch.randn(2, 3, 1024, 768, generator=generator), dim=1),
        "mask": torch.ones(2, 1, 1024, 768, dtype=torch.bool),
    }
    return (lambda: NormalEstimationModule(backbone="sapiens_0.3b", warmup_steps=0)), batch


@pytest.mark.slow
@pytest.mark.parametrize("case", [_r100, _sapiens], ids=["r100 b128 112²", "sapiens_0.3b b2 1024×768"])
def test_no_offload_is_priced_below_its_bytes_over_the_link_and_a_gpu_plan_offloads_what_the_link_hides(case):
    build, batch = case()
    with torch.device("meta"):
        names = [name for name, _ in Policy("auto").matches(build())]
    hopper = gpu("h200_141gb")
    anchor = profile_step(build, batch, mode="fake", steps=1, blocks=tuple(names), device_type="cuda",
                          workspace=hopper.workspace)  # fmt: skip
    plans = [dict.fromkeys(names, "offload"), *({name: "offload"} for name in names)]
    estimates = [checkpointed(anchor, modes) for modes in plans]
    for hardware in (gpu("h100_80gb"), hopper):
        link = hardware.host_link_gbps * GB
        for estimate in estimates:
            cost = step_cost(estimate.step_work, Work(), hardware, offloaded_bytes=estimate.offloaded_bytes,
                             regions=estimate.regions, copies=estimate.copies)  # fmt: skip
            assert estimate.offloaded_bytes > 0 and cost.total >= estimate.offloaded_bytes / link
        hidden = [name for name, seconds in unhidden_offloads(anchor, names, hardware).items() if seconds == 0.0]
        vit = [name for name in names if ".backbone.blocks." in name]
        # r100's blocks save 10-40x what their neighbours' compute can carry; a ViT block's copies just fit in the
        # next one's forward, but not the last one's (the head's layers after it are short), nor the head's
        assert hidden == vit[:-1]
    if case is _sapiens:
        choice = plan_checkpointing(build, batch, 0.5, hardware=hopper)
        assert choice.fits and [name for name, mode in choice.modes.items() if mode == "offload"] == vit[:-1]


def test_an_offload_the_link_does_not_hide_is_a_last_resort():
    options = {
        "a": (
            BlockOption("none", 0, 0.0),
            BlockOption("full", 40, 2.0),
            BlockOption("offload", 60, 1.0, last_resort=True),
        ),
        "b": (BlockOption("none", 0, 0.0), BlockOption("full", 40, 2.0)),
    }
    frontier = Frontier(options, ActivationPeaks(forward=100, backward=0))
    assert frontier.fastest(70) == {"a": "full"}  # cheaper, the unhidden copies would not be taken while this reaches
    assert frontier.fastest(15) == {"a": "offload", "b": "full"}  # only they reach it
    assert frontier.least_bytes() == 0
