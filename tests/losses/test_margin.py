import math

import pytest
import torch
import torch.nn.functional as F

from lightning_memopt.losses import CombinedMarginLoss

MARGINS = {
    "arcface": (1.0, 0.5, 0.0),
    "cosface": (1.0, 0.0, 0.4),
    "sphereface": (1.35, 0.0, 0.0),
    "combined": (1.2, 0.3, 0.2),
}


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_target_logit_matches_the_closed_form_where_the_angle_stays_below_pi(name):
    m1, m2, m3 = MARGINS[name]
    theta = torch.linspace(0.01, (math.pi - m2) / m1 - 0.01, 200, dtype=torch.float64)
    expected = torch.cos(m1 * theta + m2) - m3
    actual = CombinedMarginLoss(MARGINS[name]).target_logit(torch.cos(theta))
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("margins", [(1.0, 0.5, 0.0), (4.0, 0.0, 0.0), (1.35, 0.2, 0.1)])
def test_target_logit_keeps_falling_over_the_whole_angle_range(margins):
    theta = torch.linspace(0.0, math.pi, 2001, dtype=torch.float64)
    values = CombinedMarginLoss(margins).target_logit(torch.cos(theta))
    assert torch.all(values[1:] <= values[:-1] + 1e-9)


def test_only_the_target_column_changes_and_everything_is_scaled():
    loss_fn = CombinedMarginLoss((1.0, 0.5, 0.0), scale=64.0)
    cosine = torch.tensor([[0.9, 0.1, -0.3], [0.2, 0.3, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 2])
    logits = loss_fn.margin_logits(cosine, labels)
    expected = cosine.clone()
    expected[0, 0] = math.cos(math.acos(0.9) + 0.5)
    expected[1, 2] = math.cos(math.acos(0.4) + 0.5)
    torch.testing.assert_close(logits, 64.0 * expected, rtol=0, atol=1e-9)


def test_loss_is_cross_entropy_of_the_closed_form_logits():
    torch.manual_seed(0)
    cosine = torch.rand(8, 5) * 2 - 1
    labels = torch.randint(0, 5, (8,))
    m1, m2, m3 = 1.0, 0.0, 0.4
    logits = cosine.clone()
    logits[torch.arange(8), labels] = torch.cos(m1 * torch.acos(cosine[torch.arange(8), labels]) + m2) - m3
    expected = F.cross_entropy(30.0 * logits, labels)
    torch.testing.assert_close(CombinedMarginLoss((m1, m2, m3), scale=30.0)(cosine, labels), expected)


def test_loss_runs_in_fp32_under_autocast_and_gradients_stay_finite_at_the_poles():
    cosine = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = CombinedMarginLoss((1.0, 0.5, 0.0))(cosine, torch.tensor([0, 0]))
    assert loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(cosine.grad.float()).all()


@pytest.mark.parametrize(
    ("margin_list", "scale", "message"),
    [
        ((1.0, 0.5), 64.0, r"`margin_list` must be three numbers \(m1, m2, m3\).*got \(1.0, 0.5\)"),
        ("arcface", 64.0, r"`margin_list` must be three numbers.*got 'arcface'"),
        ((0.5, 0.5, 0.0), 64.0, r"`margin_list`=\(0.5, 0.5, 0.0\) needs m1 >= 1, m2 >= 0 and m3 >= 0"),
        ((1.0, -0.1, 0.0), 64.0, r"needs m1 >= 1, m2 >= 0 and m3 >= 0"),
        ((1.0, 0.5, 0.0), 0.0, r"`scale`=0.0 must be positive"),
    ],
)
def test_malformed_margins_raise_naming_the_argument(margin_list, scale, message):
    with pytest.raises(ValueError, match=message):
        CombinedMarginLoss(margin_list, scale)
