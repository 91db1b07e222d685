"""Plans measured on the device: which candidates are trialled, what a trial reports, and what it leaves alone."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.planner import measure_cpu, plan, trials
from lightning_memopt.planner.remembered import TrialMemory, trial_key
from lightning_memopt.planner.trials import (
    MEASURED,
    OUT_OF_MEMORY,
    OVER_BUDGET,
    _TrialPace,
    fastest_measured,
    measure_candidates,
    trial_candidates,
)

BATCH = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
OPTIONS = {
    "loss_fn": lambda model, x: model(x).square().mean(),
    "optimizer": lambda parameters: torch.optim.SGD(parameters, lr=0.1, momentum=0.9),
}


class _Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(32), *[_Block(32) for _ in range(4)])


@pytest.fixture(scope="module")
def hardware():
    return measure_cpu(2 * 2**20)  # rates timed once: every plan of the module prices alike


@pytest.fixture(scope="module")
def planned(hardware):
    return plan(_model(), BATCH, hardware, safety_margin=0.0, every_kind=True, **OPTIONS)


def _kind(knobs):
    modes = {mode for _, mode in knobs.checkpoint_blocks} or {knobs.checkpoint} - {"none"}
    return knobs.precision, knobs.micro_batch_size is not None, frozenset(modes)


def test_every_kind_searches_the_groups_the_price_alone_skips_and_chooses_alike(hardware, planned):
    priced = plan(_model(), BATCH, hardware, safety_margin=0.0, **OPTIONS)
    searched = {(c.knobs.precision, c.knobs.micro_batch_size is not None) for c in planned.candidates}
    assert searched == {(p, m) for p in ("32-true", "bf16-mixed") for m in (False, True)}
    assert len(planned.candidates) > len(priced.candidates)
    assert planned.chosen.knobs == priced.chosen.knobs
    # a step with nothing checkpointed is its group's profile, listed once
    assert len({c.knobs for c in planned.candidates}) == len(planned.candidates)


def test_trial_candidates_are_the_fastest_then_the_fastest_of_each_kind_then_the_next(planned):
    fitting = sorted((c for c in planned.candidates if c.fits), key=lambda c: (c.cost.total, c.peak_bytes))
    kinds = {_kind(c.knobs) for c in fitting}
    assert len(kinds) >= 4
    picked = trial_candidates(planned.candidates, len(kinds))
    assert picked[0].knobs == fitting[0].knobs
    assert {_kind(c.knobs) for c in picked} == kinds
    assert [c.cost.total for c in picked] == sorted(c.cost.total for c in picked)
    more = trial_candidates(planned.candidates, len(kinds) + 2)
    next_fastest = [c.knobs for c in fitting if c.knobs not in {p.knobs for p in picked}][:2]
    assert {c.knobs for c in more} == {*(c.knobs for c in picked), *next_fastest}
    assert trial_candidates(planned.candidates, 1)[0].knobs == fitting[0].knobs
    # the coarsest kinds first: each precision, then with and without micro-batches, before the checkpointing modes
    precisions = {c.knobs.precision for c in fitting}
    assert len(precisions) == 2 and {c.knobs.precision for c in trial_candidates(planned.candidates, 2)} == precisions
    coarse = {(c.knobs.precision, c.knobs.micro_batch_size is not None) for c in fitting}
    four = trial_candidates(planned.candidates, len(coarse))
    assert {(c.knobs.precision, c.knobs.micro_batch_size is not None) for c in four} == coarse


def test_trials_measure_each_candidate_and_leave_the_model_and_every_generator_as_they_were(planned):
    model = _model()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    random.seed(1)
    np.random.seed(1)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    found = measure_candidates(model, BATCH, trial_candidates(planned.candidates, 3), planned.limit_bytes, **OPTIONS)
    assert [m.outcome for m in found] == [MEASURED] * 3
    for measured in found:
        assert measured.measured_seconds > 0
        assert 0.7 < measured.measured_peak_bytes / measured.predicted_peak_bytes < 1.1  # the CPU tracker's peak
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    assert fastest_measured(found, planned.limit_bytes) == min(found, key=lambda m: m.measured_seconds)


def test_a_trial_out_of_memory_is_marked_its_memory_freed_and_those_predicted_as_large_left_untried(planned):
    model, candidates = _model(), trial_candidates(planned.candidates, 6)
    seen = {}  # what a trial allocates on the simulated device (the copy of the model is where the model is)
    for candidate in candidates:
        with SimulatedDevice(2**30, include=[BATCH]) as device:
            measure_candidates(model, BATCH, [candidate], planned.limit_bytes, **OPTIONS)
        seen[candidate.knobs] = device.peak.total_bytes
    capacity = sorted(seen.values())[len(seen) // 2]
    with SimulatedDevice(capacity, include=[BATCH]) as device:
        before = device.current().total_bytes
        found = measure_candidates(model, BATCH, candidates, planned.limit_bytes, **OPTIONS)
        assert device.current().total_bytes == before
    ran_out = [m for m in found if m.outcome == OUT_OF_MEMORY]
    assert ran_out and len(ran_out) == device.oom_count
    assert any(m.outcome == MEASURED for m in found)
    for index, measured in enumerate(found):
        if measured.outcome == MEASURED:
            assert seen[measured.knobs] <= capacity
        elif measured.outcome == OUT_OF_MEMORY:
            assert seen[measured.knobs] > capacity and measured.measured_seconds is None
        else:
            assert measured.outcome == "untried: predicted to need as much as one that ran out of memory"
            earlier = [m.predicted_peak_bytes for m in found[:index] if m.outcome == OUT_OF_MEMORY]
            assert earlier and measured.predicted_peak_bytes >= min(earlier)


def test_the_first_candidate_is_always_measured_and_the_rest_wait_on_the_time_left(planned):
    candidates = trial_candidates(planned.candidates, 3)
    found = measure_candidates(_model(), BATCH, candidates, planned.limit_bytes, seconds=1e-9, **OPTIONS)
    assert [m.outcome for m in found] == [MEASURED] + ["untried: it would end past 1e-09 s of measuring"] * 2
    assert [m.knobs for m in found] == [c.knobs for c in candidates]


def test_a_trials_expected_length_is_the_trials_so_far_scaled_by_its_predicted_step(planned):
    first, second, third = trial_candidates(planned.candidates, 3)
    pace = _TrialPace()
    assert pace.expected(first) == 0.0  # nothing run yet: the first is always tried
    pace.ran(first, 2.0)
    pace.ran(second, 4.0)
    assert pace.expected(third) == pytest.approx(6.0 * third.cost.total / (first.cost.total + second.cost.total))


def test_a_measured_miss_raises_the_predictions_of_those_left(planned):
    fastest = trial_candidates(planned.candidates, 1)[0]
    halved = {moment: {k: v // 2 for k, v in parts.items()} for moment, parts in fastest.estimate.phases.items()}
    underpredicted = replace(fastest, estimate=replace(fastest.estimate, phases=halved))
    limit = int(fastest.peak_bytes * 1.2)
    found = measure_candidates(_model(), BATCH, [underpredicted, fastest], limit, **OPTIONS)
    miss = found[0].measured_peak_bytes / underpredicted.peak_bytes
    assert found[0].outcome == MEASURED and fastest.peak_bytes * miss > limit
    assert found[1].outcome == f"untried: over the limit by the measured miss (×{miss:.3f})"
    below = found[0].measured_peak_bytes - 1
    over = measure_candidates(_model(), BATCH, [underpredicted], below, **OPTIONS)
    assert over[0].outcome == OVER_BUDGET and fastest_measured(over, below) is None


@pytest.mark.parametrize(("half_over_full", "launch"), [(1.0, 1.0), (2.0, 3.0), (0.5, 0.3)])
def test_no_group_is_pruned_that_holds_a_cheaper_step(hardware, half_over_full, launch):
    """A group's least price, bounded from a mixed-precision reference, once counted autocast's casts in a
    full-precision group: 32-true was pruned at its bound, 18 % over its cheapest step, and bf16-mixed chosen."""
    rates = replace(hardware, half_tflops=hardware.full_tflops * half_over_full, kernel_seconds=1e-5 * launch)
    pruned = plan(_model(), BATCH, rates, safety_margin=0.0, **OPTIONS)
    every = plan(_model(), BATCH, rates, safety_margin=0.0, every_kind=True, **OPTIONS)
    cheapest = {}
    for candidate in every.candidates:
        group = (candidate.knobs.precision, candidate.knobs.micro_batch_size)
        cheapest[group] = min(cheapest.get(group, float("inf")), candidate.cost.total)
    for knobs, bound in pruned.skipped:
        assert bound <= cheapest.get((knobs.precision, knobs.micro_batch_size), float("inf")) * (1 + 1e-9)
    assert pruned.chosen.knobs == every.chosen.knobs


def test_the_key_of_remembered_trials_follows_the_model_the_batch_and_the_device_count():
    model, cpu = _model(), torch.device("cpu")
    key = trial_key(model, BATCH, cpu)
    assert trial_key(_model(), BATCH.clone(), cpu) == key  # other values, the same structure
    wider = nn.Sequential(nn.BatchNorm1d(32), *[_Block(32) for _ in range(3)], _Block(32), nn.Linear(32, 2))
    assert len({key, trial_key(wider, BATCH, cpu), trial_key(model, BATCH[:128], cpu)}) == 3
    assert len({key, trial_key(model, BATCH.double(), cpu), trial_key(model, BATCH, cpu, devices=2)}) == 3


def test_remembered_trials_are_not_run_again_and_their_peaks_are_weighed_against_the_new_limit(planned, tmp_path):
    memory, key = TrialMemory(tmp_path / "measurements.json"), "a key"
    candidates = trial_candidates(planned.candidates, 2)
    found = measure_candidates(_model(), BATCH, candidates, planned.limit_bytes, **OPTIONS)
    memory.remember(key, found)
    remembered = memory.recall(key, [c.knobs for c in candidates])
    limit = found[0].measured_peak_bytes - 1
    again = measure_candidates(None, BATCH, candidates, limit, device="cpu", remembered=remembered, **OPTIONS)
    assert [(m.measured_seconds, m.measured_peak_bytes) for m in again] == [
        (m.measured_seconds, m.measured_peak_bytes) for m in found
    ]
    assert all(m.remembered for m in again) and again[0].outcome == OVER_BUDGET
    assert memory.recall("another key", [c.knobs for c in candidates]) == {}


def test_the_plan_table_shows_each_trial_beside_its_price_and_says_which_times_were_measured(planned):
    measured = replace(planned, measurements=[], chosen=planned.chosen)
    assert "priced s" not in measured.table() and "step s" in measured.table()
    candidates = trial_candidates(planned.candidates, 3)
    found = measure_candidates(_model(), BATCH, candidates, planned.limit_bytes, seconds=1e-9, **OPTIONS)
    measured.measurements = [
        found[0],
        replace(found[1], remembered=True, measured_seconds=0.5, outcome=MEASURED),
        found[2],
    ]
    lines = measured.table().split("\n\n", 1)[1].splitlines()  # the table, after the answer
    header = lines[0]
    assert "priced s" in header and "measured s" in header and "measured MiB" in header and "trial" in header
    start, end = header.index("candidate"), header.index("peak")  # the candidate column
    rows = {line[start:end].strip(): line for line in lines[1:] if line[start:end].strip()}
    first, remembered, untried = (rows[c.knobs.describe()] for c in candidates)
    assert f"{found[0].measured_seconds:.4f}" in first and f"{found[0].measured_peak_bytes / 2**20:.2f}" in first
    assert " measured " in first and "0.5000" in remembered and "remembered from an earlier run" in remembered
    assert " untried " in untried and untried.endswith("; it would end past 1e-09 s of measuring")
    not_tried = next(c for c in planned.front() if c.knobs not in {m.knobs for m in found})
    assert rows[not_tried.knobs.describe()].count("—") >= 3  # shown, priced only


def test_those_measured_close_to_the_fastest_run_again_in_the_reverse_order_keeping_their_faster_step(
    planned, monkeypatch
):
    candidates = trial_candidates(planned.candidates, 3)
    times = {candidates[0].knobs: [1.0, 1.10], candidates[1].knobs: [1.05, 0.95], candidates[2].knobs: [2.0]}
    ran = []

    def scripted(trial, steps):
        ran.append(trial.knobs)
        return 1000, times[trial.knobs].pop(0)

    monkeypatch.setattr(trials.Trial, "run", scripted)
    found = measure_candidates(_model(), BATCH, candidates, planned.limit_bytes, **OPTIONS)
    assert ran == [c.knobs for c in (*candidates, candidates[1], candidates[0])]
    assert [m.measured_seconds for m in found] == [1.0, 0.95, 2.0]
    assert fastest_measured(found, planned.limit_bytes).knobs == candidates[1].knobs
