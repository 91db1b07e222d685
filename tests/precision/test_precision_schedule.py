import pytest
from omegaconf import OmegaConf

from lightning_memopt.precision import PrecisionSchedule


def test_boundaries_of_a_step_schedule():
    schedule = PrecisionSchedule({0: "32-true", 500: "bf16-mixed"})
    assert [schedule.at(step) for step in (0, 499, 500, 10_000)] == ["32-true", "32-true", "bf16-mixed", "bf16-mixed"]


def test_before_the_first_entry_and_in_gaps_nothing_is_scheduled():
    schedule = PrecisionSchedule([[10, "bf16"], {"start": 20, "end": 30, "precision": 32}, [40, "16-mixed"]])
    assert [schedule.at(s) for s in (9, 10, 19, 20, 29, 30, 39, 40)] == [
        None, "bf16-mixed", "bf16-mixed", "32-true", "32-true", None, None, "16-mixed",
    ]  # fmt: skip


def test_auto_is_a_valid_entry_and_hydra_containers_work():
    schedule = PrecisionSchedule(OmegaConf.create({0: "32-true", 100: "auto"}), interval="epoch")
    assert (schedule.at(99), schedule.at(100), schedule.interval) == ("32-true", "auto", "epoch")
    assert schedule.describe() == "epoch 0: 32-true, epoch 100: auto"
    listed = PrecisionSchedule(OmegaConf.create([[0, "32-true"], {"start": 5, "precision": "bf16-mixed"}]))
    assert listed.at(5) == "bf16-mixed"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({500: "bf16-mixed", 0: "32-true"}, r"not sorted: the entry starting at step 0 comes after the one at"),
        ([[0, "32-true"], [0, "bf16-mixed"]], r"entries overlap: step 0: 32-true and step 0: bf16-mixed"),
        ([{"start": 0, "end": 600, "precision": "32-true"}, [500, "bf16-mixed"]],
         r"entries overlap: step 0–600: 32-true and step 500: bf16-mixed"),
        ([{"start": 5, "end": 5, "precision": "32-true"}], r"`end`=5; it must be after the start"),
        ({-1: "32-true"}, r"start -1 must be a step or epoch number ≥ 0"),
        ({0: "fp8"}, r"Unknown `schedule precision`='fp8'"),
        ([{"begin": 0, "precision": "32-true"}], r"needs the keys start and precision.*unknown keys: \['begin'\]"),
        (["32-true"], r"must be a \[start, precision\] pair"),
        ({}, r"`schedule` is empty"),
        (5, r"`schedule` must be \{start: precision\} or a list .*, got 5 \(int\)"),
        ("bf16-mixed", r"`schedule` must be \{start: precision\} or a list .*, got 'bf16-mixed' \(str\)"),
        ({"abc": "32-true"}, r"`schedule` start 'abc' must be a step or epoch number ≥ 0"),
        ({True: "32-true"}, r"`schedule` start True must be a step or epoch number ≥ 0"),
    ],
)  # fmt: skip
def test_bad_schedules_say_what_is_wrong(entries, message):
    with pytest.raises(ValueError, match=message):
        PrecisionSchedule(entries)


def test_unknown_interval():
    with pytest.raises(ValueError, match=r"Unknown `schedule_interval`='batch'; valid choices: step, epoch"):
        PrecisionSchedule({0: "32-true"}, interval="batch")
