"""Golden outputs of the official IResNet and Sapiens (issue 41): ours reproduces them, a swapped layout does not.

Each fixture in ``golden/`` holds what the official code (insightface ``arcface_torch``, facebookresearch/sapiens;
commit, command and seed in the file) computed for a fixed input with its tensors drawn from a seed in the official
order (``golden.draw_official_state_dict``): IResNet-18 embeddings, the raw normals of a narrow Sapiens. Here the
same tensors are drawn, converted to our layout and run through our preset; then any two same-shaped official layers
are exchanged before the conversion, and the outputs must then differ far beyond the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from lightning_memopt.models import create_model
from lightning_memopt.models.official import convert_official_state_dict
from tests.models.golden import (
    draw_official_state_dict,
    golden_tensor,
    load_golden,
    same_shaped_layer_pairs,
    swap_layers,
)

FIXTURES = ["iresnet_r18", "sapiens_normal_tiny"]
# A swapped layout must move some output by at least this many times the tolerance.
MISMATCH_FACTOR = 100
# The Sapiens head's refine stages 0 and 1 (two 1×1 convs of one shape): a swap of them once passed every test.
REFINE_SWAP = ("decode_head.conv_layers.0", "decode_head.conv_layers.3")


@dataclass
class Case:
    """A fixture with what its tests share: the drawn official state dict and the input images."""

    golden: dict
    kwargs: dict
    official: dict[str, Tensor]
    images: Tensor

    @property
    def output(self) -> str:
        """The name of the fixture's one output (``embeddings`` or ``normals``)."""
        (name,) = self.golden["outputs"]
        return name

    def difference(self, official: dict[str, Tensor]) -> float:
        """The largest |ours − official golden| when our preset runs on ``official`` converted to our layout."""
        preset = self.golden["preset"]
        with torch.device("meta"):
            model = create_model(preset, **self.kwargs)
        model.load_state_dict(convert_official_state_dict(official, preset, **self.kwargs), strict=True, assign=True)
        with torch.no_grad():
            ours = model.eval()(self.images)
        return float((ours.double() - golden_tensor(self.golden["outputs"][self.output])).abs().max())

    def pairs(self) -> list[tuple[str, str]]:
        """Every pair of same-shaped layers of the official layout."""
        return same_shaped_layer_pairs(self.golden["tensors"])


def make_case(name: str) -> Case:
    """The fixture ``name``: the official state dict drawn from its seed, and its input."""
    golden = load_golden(name)
    kwargs = {key: tuple(value) if isinstance(value, list) else value for key, value in golden["preset_kwargs"].items()}
    spec = golden["input"]
    images = torch.randn(spec["shape"], generator=torch.Generator().manual_seed(spec["seed"]))
    return Case(golden, kwargs, draw_official_state_dict(golden["tensors"], golden["seed"]), images)


@pytest.fixture(scope="module", params=FIXTURES)
def case(request) -> Case:
    return make_case(request.param)


def _assert_mismatch(case: Case, first: str, second: str) -> None:
    """Swapping layers ``first`` and ``second`` moves the output far beyond the tolerance.

    No pair is exempt: in both fixtures every pair's tensors are drawn independently (only ``num_batches_tracked``
    is zero in every BatchNorm, and it is unused in eval mode), and each swapped layer lies on the output's path.
    """
    moved = case.difference(swap_layers(case.official, first, second))
    assert moved > MISMATCH_FACTOR * case.golden["tolerance"][case.output], (first, second, moved)


def test_ours_reproduces_the_official_outputs(case):
    assert case.golden["official"]["commit"]
    difference = case.difference(case.official)
    assert difference <= case.golden["tolerance"][case.output], difference


def _first_pair_of_each_kind(case: Case) -> list[tuple[str, str]]:
    """One swap per group of same-shaped layers: the first pair of each group, in the official order."""
    signatures: dict[str, list] = {}
    for key, shape, _ in case.golden["tensors"]:
        layer, _, name = key.rpartition(".")
        signatures.setdefault(layer, []).append((name, tuple(shape)))
    kinds: dict[tuple, tuple[str, str]] = {}
    for first, second in case.pairs():
        kinds.setdefault(tuple(sorted(signatures[first])), (first, second))
    return list(kinds.values())


def test_swapping_a_pair_of_each_kind_of_layer_changes_the_outputs(case):
    pairs = _first_pair_of_each_kind(case)
    if case.golden["family"] == "Sapiens":
        assert REFINE_SWAP in pairs
    for first, second in pairs:
        _assert_mismatch(case, first, second)


@pytest.mark.slow
def test_every_swap_of_two_same_shaped_layers_changes_the_outputs(case):
    pairs = case.pairs()
    assert len(pairs) == case.golden["swap_pairs"]
    for first, second in pairs:
        _assert_mismatch(case, first, second)
