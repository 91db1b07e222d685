import pytest
import torch

from lightning_memopt.metrics import FaceVerification
from lightning_memopt.metrics.functional import tar_at_far, verification_accuracy
from lightning_memopt.metrics.functional.verification import best_threshold


def scored_pairs(pairs=200, seed=0):
    generator = torch.Generator().manual_seed(seed)
    same = torch.rand(pairs, generator=generator) < 0.5
    scores = torch.where(same, 0.6, 0.3) + 0.2 * torch.randn(pairs, generator=generator)
    return scores, same


def brute_threshold(scores, same):
    values = sorted(set(scores.double().tolist()))
    candidates = [-float("inf")] + [(a + b) / 2 for a, b in zip(values, values[1:], strict=False)] + [float("inf")]
    accuracy = [((scores.double() >= t) == same).double().mean().item() for t in candidates]
    best = max(accuracy)
    return candidates[accuracy.index(best)], best


def test_best_threshold_matches_brute_force():
    scores, same = scored_pairs()
    assert best_threshold(scores, same) == pytest.approx(brute_threshold(scores, same))
    tied = torch.tensor([0.5, 0.5, 0.5, 0.2]), torch.tensor([True, False, True, False])
    assert best_threshold(*tied) == pytest.approx(brute_threshold(*tied))


def test_ten_fold_accuracy_matches_brute_force():
    scores, same = scored_pairs(203)  # folds of 20 and 21
    bounds = [round(i * 203 / 10) for i in range(11)]
    accuracies = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        train = torch.ones(203, dtype=torch.bool)
        train[start:stop] = False
        threshold, _ = brute_threshold(scores[train], same[train])
        accuracies.append(((scores[start:stop].double() >= threshold) == same[start:stop]).double().mean().item())
    assert verification_accuracy(scores, same)[0] == pytest.approx(sum(accuracies) / 10, abs=1e-12)


@pytest.mark.parametrize("far", [1e-3, 0.01, 0.1, 0.5])
def test_tar_at_far_is_the_best_rate_within_the_false_accepts(far):
    scores, same = scored_pairs(2000)
    negatives, positives = scores[~same], scores[same]
    best = 0.0
    for threshold in [-float("inf"), *scores.tolist()]:
        if (negatives > threshold).double().mean() <= far:
            best = max(best, (positives > threshold).double().mean().item())
    assert tar_at_far(scores, same, far) == pytest.approx(best)


def test_tar_at_a_far_too_small_for_the_negatives_warns_and_allows_no_false_accept():
    scores = torch.tensor([0.9, 0.6, 0.8, 0.5, 0.7])
    same = torch.tensor([True, True, False, False, False])
    with pytest.warns(UserWarning, match=r"TAR at FAR=0.001 needs ≥ 1000 different-identity pairs to resolve, got 3"):
        assert tar_at_far(scores, same, 1e-3) == 0.5  # only 0.9 is above the highest negative, 0.8


def test_the_metric_from_embeddings_or_labels():
    generator = torch.Generator().manual_seed(1)
    first, second = torch.randn(300, 16, generator=generator), torch.randn(300, 16, generator=generator)
    same = torch.rand(300, generator=generator) < 0.5
    second[same] = first[same] + 0.5 * torch.randn(int(same.sum()), 16, generator=generator)
    metric = FaceVerification(far_targets=(1e-2, 1e-1))
    for start in range(0, 300, 64):
        metric.update(first[start : start + 64], second[start : start + 64], same[start : start + 64])
    result = metric.compute()
    scores = torch.nn.functional.cosine_similarity(first, second)
    assert result["accuracy"] == pytest.approx(verification_accuracy(scores, same)[0])
    assert result["tar_at_far_0.01"] == pytest.approx(tar_at_far(scores, same, 1e-2))
    assert set(result) == {"accuracy", "threshold", "tar_at_far_0.01", "tar_at_far_0.1"}
    by_labels = FaceVerification(far_targets=(1e-1,))
    labels = torch.arange(300)
    by_labels.update(first, second, first_labels=labels, second_labels=torch.where(same, labels, labels + 1000))
    assert by_labels.compute()["accuracy"] == pytest.approx(result["accuracy"])
    assert len(metric.scores) == 5 and metric.scores[0].shape == (64,)  # one score per pair, never the embeddings


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FaceVerification(folds=1), "`folds` must be an integer ≥ 2, got 1"),
        (lambda: FaceVerification(folds=-10), "`folds` must be an integer ≥ 2, got -10"),
        (lambda: FaceVerification(far_targets=(0.0,)), r"`far_targets` must be a number > 0 and ≤ 1, got 0.0"),
        (lambda: FaceVerification(far_targets=(1e-3, 1.5)), r"`far_targets` must be a number > 0 and ≤ 1, got 1.5"),
        (lambda: FaceVerification().update(torch.randn(4, 2), torch.randn(3, 2), torch.ones(4)), r"\[4, 2\]"),
        (lambda: FaceVerification().update(torch.randn(4, 2), torch.randn(4, 2)), "give `same`, or both"),
        (lambda: FaceVerification().update(torch.randn(4, 2), torch.randn(4, 2), torch.ones(3)), "one flag per pair"),
        (lambda: FaceVerification().compute(), "before any update"),
        (lambda: verification_accuracy(torch.rand(5), torch.ones(5, dtype=torch.bool), folds=10), r"\[2, number"),
        (lambda: tar_at_far(torch.rand(5), torch.ones(5, dtype=torch.bool), 0.1), "1 kind|5 same, 0 different"),
        (
            lambda: tar_at_far(torch.rand(5), torch.ones(5, dtype=torch.bool), 2.0),
            r"`far` must be a number > 0 and ≤ 1",
        ),
    ],
)
def test_bad_input(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FaceVerification(folds="10"), r"`folds` must be an integer ≥ 2, got '10' \(str\)"),
        (lambda: FaceVerification(folds=True), r"`folds` must be an integer ≥ 2, got True \(bool\)"),
        (lambda: FaceVerification(far_targets=["1e-3"]), r"`far_targets` must be a number > 0 and ≤ 1, got '1e-3'"),
        (lambda: FaceVerification(far_targets="1e-3"), r"`far_targets` must be a list of FARs in \(0, 1\]"),
        (lambda: FaceVerification(far_targets=0.001), r"`far_targets` must be a list of FARs .*, got 0.001 \(float\)"),
        (lambda: tar_at_far(torch.rand(5), torch.ones(5, dtype=torch.bool), "0.1"), r"`far` must be a number > 0"),
    ],
)
def test_input_of_the_wrong_type(build, message):
    with pytest.raises(TypeError, match=message):
        build()


def test_pair_indices_restore_the_list_order_and_drop_repeats():
    scores, same = scored_pairs(60)
    embeddings_a = torch.stack([torch.ones(60), torch.zeros(60)], dim=1)
    angle = torch.arccos(scores.clamp(-1, 1))
    embeddings_b = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)  # cosine with a: the score
    reference = FaceVerification(folds=10, far_targets=(0.1,))
    reference.update(embeddings_a, embeddings_b, same)
    # as a padding DistributedSampler over 2 ranks deals them: 0, 2, 4, … then 1, 3, …, 59, 0 (a repeat)
    dealt = torch.cat([torch.arange(0, 60, 2), torch.arange(1, 60, 2), torch.tensor([0])])
    shuffled = FaceVerification(folds=10, far_targets=(0.1,))
    for part in dealt.split(16):
        shuffled.update(embeddings_a[part], embeddings_b[part], same[part], pair_indices=part)
    assert shuffled.compute() == pytest.approx(reference.compute())
    unordered = FaceVerification(folds=10, far_targets=(0.1,))
    unordered.update(embeddings_a[dealt[:-1]], embeddings_b[dealt[:-1]], same[dealt[:-1]])
    assert unordered.compute()["accuracy"] != pytest.approx(reference.compute()["accuracy"])  # the folds differ
    mixed = FaceVerification()
    mixed.update(embeddings_a[:4], embeddings_b[:4], same[:4], pair_indices=torch.arange(4))
    mixed.update(embeddings_a[4:], embeddings_b[4:], same[4:])
    with pytest.raises(ValueError, match="`pair_indices` came with 4 of the 60 pairs"):
        mixed.compute()
