import pytest

from lightning_memopt.callbacks.accumulation_scheduler import AccumulationSchedule


def test_counts_by_optimizer_step():
    schedule = AccumulationSchedule({1000: 4, "10": 2})  # unsorted; a key as Hydra may give it
    assert [schedule.at(step) for step in (0, 9, 10, 999, 1000, 5000)] == [1, 1, 2, 2, 4, 4]
    assert schedule.describe() == "{10: 2, 1000: 4}"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({}, "must be a non-empty"),
        ([(0, 2)], "must be a non-empty"),
        ({-1: 2}, "step -1 must be an int ≥ 0"),
        ({1.5: 2}, "step 1.5 must be"),
        ({0: 0}, r"`accumulate_schedule`\[0\]=0 must be an int ≥ 1"),
        ({0: "four"}, r"\[0\]='four' must be"),
    ],
)
def test_bad_schedules(entries, message):
    with pytest.raises(ValueError, match=message):
        AccumulationSchedule(entries)
