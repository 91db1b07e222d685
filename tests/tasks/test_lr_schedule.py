import math

import pytest

from lightning_memopt.tasks.common import warmup_decay


def test_linear_warmup_then_polynomial_decay_to_zero():
    factor = warmup_decay(total_steps=12, warmup_steps=4, schedule="polynomial", power=2.0)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == 1.0
    assert factor(8) == pytest.approx((1 - 4 / 8) ** 2)
    assert factor(12) == 0.0 and factor(50) == 0.0


def test_cosine_decay_and_constant():
    cosine = warmup_decay(total_steps=10, schedule="cosine")
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0)
    assert cosine(3) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))
    assert warmup_decay(total_steps=10, schedule="constant")(9) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": 10, "schedule": "step"}, r"Unknown `schedule`='step'; valid choices: polynomial, cosine"),
        ({"total_steps": 10, "warmup_steps": 10}, r"`warmup_steps`=10 must be in \[0, total_steps=10\)"),
        ({"total_steps": 10, "warmup_steps": -1}, r"`warmup_steps`=-1 must be in \[0, total_steps=10\)"),
        ({"total_steps": 10, "power": 0}, r"`power` must be a number > 0, got 0"),
        ({"total_steps": 10, "schedule": None}, r"Unknown `schedule`=None; valid choices: polynomial"),
    ],
)
def test_bad_schedule_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        warmup_decay(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": "10"}, r"`total_steps` must be an integer ≥ 0, got '10' \(str\)"),
        ({"total_steps": 10, "warmup_steps": "2"}, r"`warmup_steps` must be an integer, got '2' \(str\)"),
        ({"total_steps": 10, "warmup_steps": True}, r"`warmup_steps` must be an integer, got True \(bool\)"),
        ({"total_steps": 10, "power": "2"}, r"`power` must be a number > 0, got '2' \(str\)"),
    ],
)
def test_schedule_arguments_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        warmup_decay(**kwargs)
