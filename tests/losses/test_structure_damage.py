import math

import pytest
import torch

from lightning_memopt.losses import hard_sample_probability, prediction_entropy


def reference_em(values, iterations):
    """The Gaussian–uniform EM in plain Python floats."""
    low, high = min(values), max(values)
    floor = (1e-3 * (high - low)) ** 2
    weight, mean = 0.5, sum(values) / len(values)
    variance = max(sum((v - mean) ** 2 for v in values) / len(values), floor)
    for _ in range(iterations):
        gaussian = [weight * math.exp(-0.5 * (v - mean) ** 2 / variance) / math.sqrt(2 * math.pi * variance)
                    for v in values]  # fmt: skip
        uniform = (1 - weight) / (high - low)
        responsibility = [g / (g + uniform) for g in gaussian]
        total = sum(responsibility)
        weight = total / len(values)
        mean = sum(r * v for r, v in zip(responsibility, values, strict=True)) / total
        variance = max(sum(r * (v - mean) ** 2 for r, v in zip(responsibility, values, strict=True)) / total, floor)
    return [1 - r if v > mean else 0.0 for r, v in zip(responsibility, values, strict=True)]


def entropies(seed=0):
    generator = torch.Generator().manual_seed(seed)
    easy = 0.4 + 0.05 * torch.randn(120, generator=generator)
    hard = 1.0 + 3.0 * torch.rand(12, generator=generator)
    return torch.cat([easy, hard])


@pytest.mark.parametrize("iterations", [1, 5, 20])
def test_em_matches_a_plain_reference(iterations):
    values = entropies()
    expected = reference_em(values.double().tolist(), iterations)
    torch.testing.assert_close(hard_sample_probability(values, iterations).double(), torch.tensor(expected).double(),
                               rtol=0, atol=1e-4)  # fmt: skip


def test_outliers_are_hard_and_the_bulk_is_easy():
    probability = hard_sample_probability(entropies(1))
    assert probability[120:].min() > 0.99
    assert probability[:120].median() < 0.01


def test_entropy_is_shannons_and_carries_no_gradient():
    logits = torch.randn(6, 10, requires_grad=True)
    probabilities = logits.detach().softmax(dim=1)
    expected = -(probabilities * probabilities.log()).sum(dim=1)
    entropy = prediction_entropy(logits)
    torch.testing.assert_close(entropy, expected)
    assert not entropy.requires_grad
    assert prediction_entropy(torch.zeros(2, 8)).tolist() == pytest.approx([math.log(8)] * 2)


def test_equal_values_are_all_easy_and_a_tight_bulk_stays_easy():
    assert hard_sample_probability(torch.full((5,), 0.3)).tolist() == [0.0] * 5
    tight = torch.cat([torch.zeros(127), torch.tensor([1e-3])])  # all confident, one a little less
    probability = hard_sample_probability(tight)
    assert probability[:127].max() < 1e-3 and probability[127] > 0.99


def test_very_confident_outliers_are_not_hard():
    values = torch.cat([entropies(2), torch.tensor([-5.0, -4.0])])  # far below the bulk
    probability = hard_sample_probability(values)
    assert probability[-2:].tolist() == [0.0, 0.0]
    assert probability[120:132].min() > 0.99


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hard_sample_probability(torch.zeros(3, 2)), r"`values` \[3, 2\] must be one value per sample"),
        (lambda: hard_sample_probability(torch.zeros(3), iterations=0), "`iterations`=0 must be an int ≥ 1"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
