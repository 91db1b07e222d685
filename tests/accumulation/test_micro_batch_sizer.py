import pytest

from lightning_memopt.accumulation.sizing import MicroBatchSizer


def test_whole_batches_until_a_recovery():
    sizer = MicroBatchSizer()
    assert sizer.size_for(0, 64) == 64 and sizer.size_for(500, 32) == 32
    sizer.recovered(step=7, size=16)
    assert sizer.size_for(8, 64) == 16 and sizer.size_for(9, 8) == 8  # never above the batch
    assert sizer.oom_recoveries == 1


def test_first_size_from_the_planner():
    assert MicroBatchSizer(size=12).size_for(0, 64) == 12


def test_grows_back_after_quiet_steps_and_never_above_the_batch():
    sizer = MicroBatchSizer(grow_after=5)
    sizer.recovered(step=10, size=16)
    assert [sizer.size_for(step, 64) for step in (14, 15, 19, 20)] == [16, 32, 32, 64]
    assert sizer.size is None  # whole batches again


def test_a_growth_that_fails_doubles_the_wait():
    sizer = MicroBatchSizer(grow_after=5)
    sizer.recovered(step=0, size=8)
    assert sizer.size_for(5, 64) == 16  # grew at step 5
    sizer.recovered(step=7, size=8)  # ... and failed two steps later
    assert sizer.grow_interval == 10
    assert sizer.size_for(16, 64) == 8 and sizer.size_for(17, 64) == 16
    sizer.recovered(step=100, size=8)  # long after the growth: the wait stays
    assert sizer.grow_interval == 10


def test_allocator_thrashing_shrinks_before_failing():
    sizer = MicroBatchSizer(thrash_steps=3)
    assert not sizer.allocator_retried(True, 1, 64)
    assert not sizer.allocator_retried(False, 2, 64)  # the streak breaks
    assert not sizer.allocator_retried(True, 3, 64) and not sizer.allocator_retried(True, 4, 64)
    assert sizer.allocator_retried(True, 5, 64)
    assert sizer.size == 32 and sizer.preemptive_shrinks == 1 and sizer.oom_recoveries == 0
    off = MicroBatchSizer(thrash_steps=None)
    assert not any(off.allocator_retried(True, step, 64) for step in range(10))


def test_state_round_trip():
    sizer = MicroBatchSizer(grow_after=4, thrash_steps=2)
    sizer.recovered(step=3, size=6)
    sizer.size_for(7, 64)
    restored = MicroBatchSizer(grow_after=4, thrash_steps=2)
    restored.load_state_dict(sizer.state_dict())
    expected = {
        "size": 12,
        "grow_after": 4,
        "grow_interval": 4,
        "oom_recoveries": 1,
        "preemptive_shrinks": 0,
        "last_change_step": 7,
        "grew_at": 7,
        "largest_batch": 64,
    }
    assert restored.state_dict() == sizer.state_dict() == expected
    changed = MicroBatchSizer(grow_after=None)
    changed.load_state_dict(sizer.state_dict())
    assert changed.grow_interval is None and changed.size == 12  # the new `grow_after` wins
    smaller = MicroBatchSizer(size=4)
    smaller.load_state_dict(sizer.state_dict())
    assert smaller.size == 4  # resumed with a smaller size (after an error that stopped the run): it wins
    larger = MicroBatchSizer(size=32)
    larger.load_state_dict(sizer.state_dict())
    assert larger.size == 12


def test_a_short_last_batch_does_not_end_the_micro_batching():
    sizer = MicroBatchSizer(grow_after=1)
    sizer.size_for(0, 64)
    sizer.recovered(step=0, size=16)
    assert sizer.size_for(1, 20) == 20 and sizer.size == 32  # grew to 32 (of 64), clamped to this batch


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"size": 0}, "`micro_batch_size`=0 must be an int ≥ 1 or None"),
        ({"grow_after": 2.5}, "`grow_after`=2.5 must be"),
        ({"thrash_steps": True}, "`thrash_steps`=True must be"),
    ],
)
def test_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=message):
        MicroBatchSizer(**arguments)
