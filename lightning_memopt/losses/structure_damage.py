"""TopoFR's structure-damage score: how likely a sample is hard, from a Gaussian–uniform fit of entropies."""

from __future__ import annotations

import torch
from torch import Tensor

_EPS = 1e-6
_RELATIVE_FLOOR = 1e-3  # the Gaussian's standard deviation is at least this share of the values' range


def prediction_entropy(logits: Tensor) -> Tensor:
    """``[B]`` Shannon entropy (nats) of each row's softmax, in fp32, without gradient.

    Example::

        >>> [round(value, 4) for value in prediction_entropy(torch.tensor([[0.0, 0.0], [100.0, 0.0]])).tolist()]
        [0.6931, 0.0]
    """
    log_probabilities = torch.log_softmax(logits.detach().float(), dim=1)
    return -(log_probabilities.exp() * log_probabilities).sum(dim=1)


def hard_sample_probability(values: Tensor, iterations: int = 10) -> Tensor:
    """``[B]`` posterior probability that each value comes from the uniform ("hard") component.

    Fits ``π · N(μ, σ²) + (1 − π) · U(min, max)`` to ``values`` by ``iterations`` EM steps on their
    device, with no transfer to the host: the bulk of the batch (easy samples, entropies close
    together) is the Gaussian; samples whose entropy lies outside it, spread over the range, are
    the uniform. Starts from ``π = ½`` and the values' mean and variance. Only samples *above* the
    Gaussian's mean can be hard (a very confident sample is not); equal values are all easy; the
    Gaussian's standard deviation is kept ≥ 0.1% of the range, so a tight bulk stays the bulk.

    Raises:
        ValueError: for ``values`` that are not ``[B]``, or ``iterations`` < 1.

    Example::

        >>> entropy = torch.tensor([0.10, 0.11, 0.09, 0.10, 0.12, 0.08, 2.0])
        >>> [round(p, 2) for p in hard_sample_probability(entropy).tolist()]
        [0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 1.0]
    """
    if values.dim() != 1:
        raise ValueError(f"`values` {list(values.shape)} must be one value per sample, [B]")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"`iterations`={iterations!r} must be an int ≥ 1")
    values = values.detach().float()
    spread = values.max() - values.min()
    uniform_density = 1.0 / spread.clamp_min(torch.finfo(values.dtype).tiny)
    floor = (_RELATIVE_FLOOR * spread).pow(2).clamp_min(torch.finfo(values.dtype).tiny)  # the bulk's least variance
    weight = values.new_tensor(0.5)
    mean, variance = values.mean(), values.var(unbiased=False).clamp_min(floor)
    for _ in range(iterations):
        gaussian = weight * torch.exp(-0.5 * (values - mean).pow(2) / variance) / torch.sqrt(2 * torch.pi * variance)
        uniform = (1 - weight) * uniform_density
        responsibility = gaussian / (gaussian + uniform).clamp_min(torch.finfo(values.dtype).tiny)
        total = responsibility.sum().clamp_min(_EPS)
        weight = (total / values.numel()).clamp(_EPS, 1 - _EPS)
        mean = (responsibility * values).sum() / total
        variance = ((responsibility * (values - mean).pow(2)).sum() / total).clamp_min(floor)
    # hard means more uncertain than the bulk: values below its mean are easy, and equal values all easy
    hard = torch.where(values > mean, 1 - responsibility, torch.zeros_like(values))
    return torch.where(spread > 0, hard, torch.zeros_like(values))
