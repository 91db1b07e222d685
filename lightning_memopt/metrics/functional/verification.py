"""Face verification from pair scores: accuracy by k-fold threshold selection (the LFW protocol), TAR at FAR."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from lightning_memopt.arguments import check_float


def _check(scores: torch.Tensor, same: torch.Tensor) -> None:
    if scores.dim() != 1 or same.shape != scores.shape:
        raise ValueError(f"`scores` {list(scores.shape)} and `same` {list(same.shape)} must be 1-D and equally long")


def best_threshold(scores: torch.Tensor, same: torch.Tensor) -> tuple[float, float]:
    """The threshold (accept when ``score >= threshold``) with the highest accuracy on these pairs, and that accuracy.

    Candidates lie halfway between consecutive distinct scores, plus -inf (accept all) and +inf
    (accept none); among equally accurate ones the lowest wins.

    Example::

        >>> best_threshold(torch.tensor([0.875, 0.75, 0.25, 0.125]), torch.tensor([True, True, False, False]))
        (0.5, 1.0)
    """
    _check(scores, same)
    order = torch.argsort(scores)
    sorted_scores, sorted_same = scores[order].double(), same[order]
    values, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts  # where each distinct score begins
    rejected_negatives = torch.cumsum(~sorted_same, 0) - (~sorted_same).long()  # below each position
    accepted_positives = same.sum() - (torch.cumsum(sorted_same, 0) - sorted_same.long())  # from each position on
    correct = torch.cat([rejected_negatives[starts] + accepted_positives[starts], (~same).sum().view(1)])
    inf = torch.tensor([torch.inf], dtype=torch.float64)
    thresholds = torch.cat([-inf, (values[1:] + values[:-1]) / 2, inf])  # accepting from each distinct score on
    best = int(torch.argmax(correct))  # the first maximum: the lowest threshold
    return float(thresholds[best]), float(correct[best]) / scores.numel()


def verification_accuracy(scores: torch.Tensor, same: torch.Tensor, folds: int = 10) -> tuple[float, float]:
    """Mean test accuracy over ``folds`` contiguous folds, each thresholded on the others; and the mean threshold.

    Raises:
        ValueError: for mismatched inputs, or fewer pairs than folds.

    Example::

        >>> scores = torch.cat([torch.linspace(0.0, 0.3, 10), torch.linspace(0.7, 1.0, 10)])
        >>> verification_accuracy(scores, scores > 0.5, folds=10)
        (1.0, 0.5)
    """
    _check(scores, same)
    if isinstance(folds, bool) or not isinstance(folds, int) or not 2 <= folds <= scores.numel():
        raise ValueError(f"`folds`={folds!r} must be an int in [2, number of pairs = {scores.numel()}]")
    bounds = torch.linspace(0, scores.numel(), folds + 1).round().long().tolist()
    accuracies, thresholds = [], []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        train = torch.ones(scores.numel(), dtype=torch.bool)
        train[start:stop] = False
        threshold, _ = best_threshold(scores[train], same[train])
        accepted = scores[start:stop].double() >= threshold
        accuracies.append(float((accepted == same[start:stop]).double().mean()))
        thresholds.append(threshold)
    finite = [t for t in thresholds if abs(t) != float("inf")]
    return sum(accuracies) / folds, (sum(finite) / len(finite)) if finite else float("inf")


def check_far(far: Any, argument: str = "far") -> float:
    """``far`` as a float in (0, 1]: a false-accept rate; ``argument`` names it in errors.

    Raises:
        TypeError: not a number.
        ValueError: outside (0, 1].

    Example::

        >>> check_far(1e-3)
        0.001
    """
    return check_float(argument, far, minimum=0, open_minimum=True, maximum=1)


def tar_at_far(scores: torch.Tensor, same: torch.Tensor, far: float) -> float:
    """True-accept rate at the threshold where at most ``far`` of the different-identity pairs are accepted.

    A pair is accepted when its score is *above* the threshold, the ``⌊far · negatives⌋ + 1``-th
    highest negative score, so ties at the threshold are rejected. With fewer than ``1 / far``
    negatives no false accept is allowed, and a warning says so.

    Raises:
        ValueError: for ``far`` outside (0, 1], or without positive or negative pairs.

    Example::

        >>> tar_at_far(torch.tensor([0.9, 0.7, 0.8, 0.2]), torch.tensor([True, True, False, False]), far=0.25)
        0.5
    """
    _check(scores, same)
    far = check_far(far)
    negatives, positives = scores[~same].double(), scores[same].double()
    if negatives.numel() == 0 or positives.numel() == 0:
        raise ValueError(
            f"TAR at FAR needs both kinds of pairs: {positives.numel()} same, {negatives.numel()} different"
        )
    allowed = int(far * negatives.numel())
    if allowed == 0 and far * negatives.numel() < 1:
        warnings.warn(
            f"TAR at FAR={far:g} needs ≥ {math.ceil(1 / far)} different-identity pairs to resolve, got "
            f"{negatives.numel()}: the value given is TAR at FAR 0 (above the highest negative score)",
            stacklevel=2,
        )
    ranked = torch.sort(negatives, descending=True).values
    threshold = ranked[allowed] if allowed < ranked.numel() else torch.tensor(-torch.inf, dtype=torch.float64)
    return float((positives > threshold).double().mean())
