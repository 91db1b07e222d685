"""Golden outputs of the official CoTracker2 / CoTracker3 (issue 41): ours reproduces them, a swapped layout does not.

Each fixture in ``golden/`` holds what the official code (facebookresearch/co-tracker, commit in the file)
computed with its learnt tensors drawn from a seed (``golden.draw_official_state_dict``, official order) and its
fixed buffers (``time_emb``, ``pos_emb``) at their official values: tracks, visibility and confidence after one
refinement of one window. Here the same tensors are drawn, converted to our layout and run through our preset;
with any two same-shaped official layers exchanged before the conversion, the tracks must move far beyond the
tolerance. No pair is exempt: every one moves the tracks (the layers acting on visibility alone after one
refinement, CoTracker2's ``norm``, ``track_feat_updater`` and ``vis_predictor``, have no same-shaped partner;
CoTracker3's ``vis_conf_head`` has one, the ``flow_head``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from lightning_memopt.models import create_model
from lightning_memopt.models.official import convert_official_state_dict, official_layout
from lightning_memopt.models.official.layout import convert_to_ours
from tests.models.golden import (
    draw_official_state_dict,
    golden_tensor,
    load_golden,
    same_shaped_layer_pairs,
    swap_layers,
)

FIXTURES = ["cotracker2", "cotracker3", "cotracker3_offline"]
# A swapped layout must move some track by more than this many times the tracks' tolerance. The weakest swaps, two
# CoTracker3 virtual←point query projections, move them by 0.0066 px (33×): with random weights the tokens of a
# frame's points differ little, so re-weighting the virtual tracks' attention over them changes little.
MISMATCH_FACTOR = 10


class _Replay(nn.Module):
    """Stands in for the fnet of a run whose fnet tensors are not swapped: its features from the unswapped run."""

    def __init__(self, features: Tensor) -> None:
        super().__init__()
        self.features = features

    def forward(self, frames: Tensor) -> Tensor:
        return self.features


@dataclass
class Case:
    """A fixture with what its tests share: the drawn official state dict, the input clip and our model.

    The model is built once on the meta device; every run assigns it the converted tensors.
    """

    golden: dict
    official: dict[str, Tensor]
    video: Tensor
    queries: Tensor
    model: nn.Module
    fnet_features: Tensor | None = None  # the fnet's output with the unswapped tensors

    def convert(self, official: dict[str, Tensor]) -> dict[str, Tensor]:
        """What ``convert_official_state_dict`` returns, with the model as the template (not a new one per call)."""
        return convert_to_ours(official, official_layout(self.model))[0]

    def run(self, converted: dict[str, Tensor], replay_fnet: bool = False) -> dict[str, Tensor]:
        """Our outputs for our state dict ``converted``, as the official model returns them (sigmoids applied).

        ``replay_fnet``: the fnet's tensors are the unswapped ones, so its features are replayed, not recomputed.
        """
        replayed = _Replay(self.reference_features()) if replay_fnet else None  # before loading: it runs too
        self.model.load_state_dict(converted, strict=True, assign=True)
        fnet = self.model.fnet
        if replayed is not None:
            self.model.fnet = replayed
        try:
            with torch.no_grad():
                out = self.model(self.video, self.queries, iters=self.golden["input"]["iters"])
        finally:
            self.model.fnet = fnet
        outputs = {"tracks": out.tracks, "visibility": out.visibility.sigmoid()}
        if out.confidence is not None:
            outputs["confidence"] = out.confidence.sigmoid()
        return outputs

    def reference_features(self) -> Tensor:
        """The fnet's features with the unswapped tensors (computed once)."""
        if self.fnet_features is None:
            handle = self.model.fnet.register_forward_hook(
                lambda module, args, features: setattr(self, "fnet_features", features)
            )
            try:
                self.run(self.convert(self.official))
            finally:
                handle.remove()
        return self.fnet_features

    def differences(self, converted: dict[str, Tensor], replay_fnet: bool = False) -> dict[str, float]:
        """The largest |ours − official golden| of each stored output."""
        ours = self.run(converted, replay_fnet)
        return {
            name: float((ours[name].double() - golden_tensor(entry)).abs().max())
            for name, entry in self.golden["outputs"].items()
        }

    def swapped_track_difference(self, first: str, second: str) -> float:
        """The largest track difference with official layers ``first`` and ``second`` exchanged."""
        replay = not first.startswith("fnet.") and not second.startswith("fnet.")
        return self.differences(self.convert(swap_layers(self.official, first, second)), replay)["tracks"]

    def pairs(self) -> list[tuple[str, str]]:
        """Every pair of same-shaped learnt layers of the official layout."""
        return same_shaped_layer_pairs(learnt_specs(self.golden))


def learnt_specs(golden: dict) -> list:
    """The fixture's tensor specs without its fixed buffers: what the seed draws, in the official order."""
    return [spec for spec in golden["tensors"] if spec[0] not in golden["fixed"]]


def draw_input(golden: dict) -> tuple[Tensor, Tensor]:
    """The clip of the fixture's input recipe, and its queries (checked against the stored ones)."""
    spec = golden["input"]
    generator = torch.Generator().manual_seed(spec["seed"])
    video = torch.rand(spec["video"], generator=generator) * 255.0
    stored = golden_tensor(spec["queries"]).float()
    frames = torch.randint(0, spec["video"][1], stored.shape[:2], generator=generator).float()
    xy = torch.rand((*stored.shape[:2], 2), generator=generator) * (spec["video"][-1] - 1)
    assert torch.equal(torch.cat([frames[..., None], xy], dim=-1), stored), "the recipe no longer draws the queries"
    return video, stored


def make_case(name: str) -> Case:
    """Fixture ``name``: its official state dict drawn (fixed buffers as our layout computes them) and its input."""
    golden = load_golden(name)
    with torch.device("meta"):
        model = create_model(golden["preset"], **preset_kwargs(golden)).eval()
    drawn = draw_official_state_dict(learnt_specs(golden), golden["seed"])
    fixed = official_layout(model).fixed_tensors()
    assert sorted(fixed) == sorted(golden["fixed"])
    official = {key: drawn[key] if key in drawn else fixed[key] for key, _, _ in golden["tensors"]}
    return Case(golden, official, *draw_input(golden), model)


def preset_kwargs(golden: dict) -> dict:
    """The preset's constructor overrides the fixture was made for (JSON lists as tuples)."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in golden["preset_kwargs"].items()}


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Kernels this small only wait for a second thread (ten times slower on a loaded 2-core machine)."""
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=FIXTURES)
def case(request) -> Case:
    return make_case(request.param)


def _assert_mismatch(case: Case, first: str, second: str) -> None:
    moved = case.swapped_track_difference(first, second)
    assert moved > MISMATCH_FACTOR * case.golden["tolerance"]["tracks"], f"swapping {first} and {second}: {moved}"


def test_ours_reproduces_the_official_outputs(case):
    converted = convert_official_state_dict(case.official, case.golden["preset"], **preset_kwargs(case.golden))
    differences = case.differences(converted)
    tolerance = case.golden["tolerance"]
    assert all(differences[name] <= tolerance[name] for name in differences), differences


def _twins(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each space block's point←virtual sub-layers with their virtual←point twins (the swap a layout once had)."""
    return [(first, second) for first, second in pairs if first.replace("point2virtual", "virtual2point") == second]


def _group_ends(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The first and last layer of every group of same-shaped layers (its head never comes second in a pair)."""
    seconds = {second for _, second in pairs}
    return list({first: second for first, second in pairs if first not in seconds}.items())


def test_swapping_twin_space_layers_or_the_ends_of_a_same_shaped_group_moves_the_tracks(case):
    pairs = case.pairs()
    twins = _twins(pairs)
    assert len(twins) == 6 * (6 if case.golden["family"] == "CoTracker2" else 3)  # 6 sub-layers per space block
    for first, second in twins + _group_ends(pairs):
        _assert_mismatch(case, first, second)


@pytest.mark.slow
def test_every_swap_of_two_same_shaped_layers_moves_the_tracks(case):
    pairs = case.pairs()
    assert len(pairs) == case.golden["swap_pairs"]
    for first, second in pairs:
        _assert_mismatch(case, first, second)
