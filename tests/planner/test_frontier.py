"""The checkpointing frontier: the knapsack against brute force, and plans that meet their budget when applied."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_memopt.models import create_model
from lightning_memopt.planner import gpu
from lightning_memopt.planner.checkpoint_budget import budget_bytes, plan_checkpointing
from lightning_memopt.planner.frontier import ActivationPeaks, BlockOption, Frontier
from tests.helpers import fake_activation_peak


def _random_options(seed: int, blocks: int = 5) -> dict[str, tuple[BlockOption, ...]]:
    rng = random.Random(seed)
    options = {}
    for index in range(blocks):
        saved = rng.randint(50, 400)
        found = [BlockOption("none", 0, 0.0), BlockOption("full", saved, rng.uniform(1.0, 3.0))]
        found.append(BlockOption("selective", rng.randint(10, saved - 10), rng.uniform(0.1, 1.0)))
        output = rng.randint(0, 60)  # leaves the device too when the next block is offloaded (or none follows)
        found.append(
            BlockOption("offload", saved, rng.uniform(0.5, 4.0), held_bytes=saved + output, output_bytes=output)
        )
        if index % 2:  # a block with a lean recomputation: it holds little again in its backward
            found[1] = BlockOption("full", saved, rng.uniform(2.0, 5.0), held_bytes=saved // 8)
        options[f"block{index}"] = tuple(found)
    return options


def _freed(combination):
    freed = sum(o.freed_bytes for o in combination)
    for option, following in zip(combination, [*combination[1:], None], strict=True):
        if option.mode == "offload" and (following is None or following.mode == "offload"):
            freed += option.output_bytes
    return freed


def _brute_force(options, peaks, target):
    """The least seconds of every combination whose peak is within ``target`` (None: none is)."""
    best = None
    for combination in itertools.product(*options.values()):
        freed = _freed(combination)
        held = max((o.held for o in combination if o.mode != "none"), default=0)
        if peaks.after(freed, held) <= target:
            seconds = sum(o.seconds for o in combination)
            best = seconds if best is None else min(best, seconds)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_knapsack_finds_the_fastest_choice_that_brute_force_finds(seed):
    options = _random_options(seed)
    total = sum(max(o.freed_bytes + o.output_bytes for o in choices) for choices in options.values())
    peaks = ActivationPeaks(forward=total + 100, backward=total + 60 + seed * 10)
    frontier = Frontier(options, peaks)
    assert frontier.unit == 1  # fewer bytes than the resolution: counted exactly
    for target in range(peaks.unchecked, 0, -37):
        expected = _brute_force(options, peaks, target)
        found = frontier.fastest(target)
        if expected is None:
            assert found is None, target
            continue
        assert found is not None and frontier.peak(found) <= target
        assert frontier.seconds(found) == pytest.approx(expected), target


def test_the_least_peak_is_the_least_any_combination_reaches_and_out_of_reach_is_none():
    options = _random_options(7)
    peaks = ActivationPeaks(forward=2000, backward=1900)
    frontier = Frontier(options, peaks)
    least = min(
        peaks.after(_freed(c), max((o.held for o in c if o.mode != "none"), default=0))
        for c in itertools.product(*options.values())
    )
    assert frontier.least_bytes() == least
    assert frontier.fastest(least) is not None and frontier.fastest(least - 1) is None
    assert frontier.fastest(peaks.unchecked) == {}


def test_the_frontier_points_trade_time_for_memory():
    frontier = Frontier(_random_options(3, blocks=6), ActivationPeaks(forward=3000, backward=2900))
    points = frontier.points(16)
    peaks = [frontier.peak(modes) for modes in points]
    seconds = [frontier.seconds(modes) for modes in points]
    assert len(points) >= 4 and len({tuple(sorted(m.items())) for m in points}) == len(points)
    assert seconds == sorted(seconds)  # each point at least as slow as the one before, so none that follows is
    assert all(later < earlier for earlier, later in zip(peaks, peaks[1:], strict=False))  # dominated: it holds less


def test_large_byte_counts_are_rounded_towards_less_freed():
    options = {
        f"b{i}": (BlockOption("none", 0, 0.0), BlockOption("full", 3 * 2**30 + i * 12345, 1.0)) for i in range(4)
    }
    peaks = ActivationPeaks(forward=14 * 2**30, backward=14 * 2**30)
    frontier = Frontier(options, peaks)
    assert frontier.unit > 1
    for target in (12 * 2**30, 9 * 2**30, 7 * 2**30):
        modes = frontier.fastest(target)
        assert modes is not None and frontier.peak(modes) <= target


@pytest.mark.parametrize("budget", [0, -0.5, True, "half", float("inf"), None])
def test_a_bad_budget_names_the_argument(budget):
    with pytest.raises(ValueError, match=r"`budget`=.* must be a fraction in \(0, 1\]"):
        budget_bytes(budget, 100)


def _loss(model, batch):
    return model(batch).square().mean()


@pytest.mark.parametrize("budget", [0.8, 0.65])
def test_a_planned_choice_applied_meets_its_budget_measured(budget):
    def build():
        torch.manual_seed(0)
        return create_model("r18")

    batch = torch.randn(4, 3, 112, 112)
    choice = plan_checkpointing(build, batch, budget, loss_fn=_loss, hardware=gpu("a100_80gb"))
    assert choice.fits and choice.modes

    unchecked = fake_activation_peak(build, batch, _loss)
    checked = fake_activation_peak(build, batch, _loss, choice.policy())
    assert checked < unchecked
    # measured, the whole activation peak (temporaries too) within the budget of the unchecked one, give or take 5 %
    assert checked <= budget * unchecked * 1.05, (checked / unchecked, choice.describe())
