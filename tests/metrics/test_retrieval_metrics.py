from pathlib import Path

import pytest
import torch

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.metrics import FaceVerification, KNNRetrieval
from lightning_memopt.metrics.functional import retrieval_metrics
from tests.helpers import run_script


def clustered(samples=300, classes=12, dim=16, spread=0.9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return centres[labels] + spread * torch.randn(samples, dim, generator=generator), labels


def brute_force(query, query_labels, reference=None, reference_labels=None, metric="cosine"):
    """pytorch-metric-learning's definitions over the full score matrix, ties to the lower index."""
    same_set = reference is None
    if same_set:
        reference, reference_labels = query, query_labels
    if metric == "cosine":
        normed = torch.nn.functional.normalize
        scores = normed(query.double()) @ normed(reference.double()).T
    else:
        scores = -torch.cdist(query.double(), reference.double())
    p1 = rp = map_r = counted = 0
    for i in range(query.shape[0]):
        candidates = [j for j in range(reference.shape[0]) if not (same_set and j == i)]
        r = sum(int(reference_labels[j] == query_labels[i]) for j in candidates)
        if r == 0:
            continue
        ranked = sorted(candidates, key=lambda j: (-scores[i, j].item(), j))[:r]
        hits = [int(reference_labels[j] == query_labels[i]) for j in ranked]
        p1 += hits[0]
        rp += sum(hits) / r
        map_r += sum(sum(hits[: t + 1]) / (t + 1) * hits[t] for t in range(r)) / r
        counted += 1
    return {"precision_at_1": p1 / counted, "r_precision": rp / counted, "mean_average_precision_at_r": map_r / counted}


def assert_matches(got, expected):
    assert got["precision_at_1"] == pytest.approx(expected["precision_at_1"], abs=1e-12)
    assert got["r_precision"] == pytest.approx(expected["r_precision"], abs=1e-12)
    assert got["mean_average_precision_at_r"] == pytest.approx(expected["mean_average_precision_at_r"], abs=1e-6)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_same_set_matches_brute_force(metric):
    embeddings, labels = clustered()
    assert_matches(
        retrieval_metrics(embeddings, labels, metric=metric, chunk_size=37),
        brute_force(embeddings, labels, metric=metric),
    )


def test_separate_reference_set_matches_brute_force():
    embeddings, labels = clustered(samples=320)
    query, query_labels, reference, reference_labels = embeddings[:120], labels[:120], embeddings[120:], labels[120:]
    got = retrieval_metrics(query, query_labels, reference, reference_labels, chunk_size=50)
    assert_matches(got, brute_force(query, query_labels, reference, reference_labels))


def test_queries_without_another_reference_of_their_label_are_skipped():
    embeddings, labels = clustered(samples=60, classes=4)
    labels = labels.clone()
    labels[:3] = torch.tensor([100, 101, 102])  # three singletons
    got = retrieval_metrics(embeddings, labels)
    assert_matches(got, brute_force(embeddings, labels))
    with pytest.raises(ValueError, match="no query has another reference with its label"):
        retrieval_metrics(torch.randn(3, 4), torch.tensor([0, 1, 2]))


def test_self_exclusion_and_ties():
    # duplicates: each point's twin is at similarity 1, the point itself is not counted
    embeddings = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 1, 0])
    got = retrieval_metrics(embeddings, labels)
    assert_matches(got, brute_force(embeddings, labels))
    # ties go to the lower index: 0 finds 1 (not 4) and 1 finds 0 (not 4), both misses; 2, 3, 4 hit
    assert got["precision_at_1"] == pytest.approx(3 / 5)


def test_the_metric_accumulates_batches_and_matches_the_function():
    embeddings, labels = clustered()
    metric = KNNRetrieval(chunk_size=64)
    for start in range(0, 300, 70):
        metric.update(embeddings[start : start + 70], labels[start : start + 70])
    assert_matches(metric.compute(), brute_force(embeddings, labels))
    separate = KNNRetrieval(embeddings_on_cpu=True)
    separate.update(embeddings[:100], labels[:100])
    separate.update(embeddings[100:], labels[100:], reference=True)
    assert separate.reference_embeddings[0].device.type == "cpu"
    assert_matches(separate.compute(), brute_force(embeddings[:100], labels[:100], embeddings[100:], labels[100:]))


def test_faiss_backend_gives_the_same_values():
    pytest.importorskip("faiss")
    embeddings, labels = clustered(samples=400, dim=32)
    ours = KNNRetrieval()
    theirs = KNNRetrieval(backend="faiss")
    for metric in (ours, theirs):
        metric.update(embeddings, labels)
    assert theirs.compute() == pytest.approx(ours.compute(), abs=1e-12)


def test_compute_memory_is_bounded():
    embeddings, labels = clustered(samples=2000, classes=40, dim=32)
    metric = KNNRetrieval(max_memory=2_000_000)
    metric.update(embeddings, labels)
    tracker = MemoryTracker()
    with tracker:
        metric.compute()
    assert tracker.peak.total_bytes < 2000 * 2000 * 4 / 5  # the full matrix would be 16 MB
    assert tracker.peak.total_bytes < 2_000_000 + 2000 * 32 * 4 * 2 + 2000 * 8 * 4


def with_nan():
    metric = KNNRetrieval()
    metric.update(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), torch.zeros(2).long())
    return metric


def two_sizes():
    metric = KNNRetrieval()
    metric.update(torch.randn(4, 2), torch.zeros(4).long())
    metric.update(torch.randn(4, 3), torch.zeros(4).long(), reference=True)
    return metric


def mixed_indices():
    metric = KNNRetrieval()
    metric.update(torch.randn(4, 2), torch.zeros(4).long(), indices=torch.arange(4))
    metric.update(torch.randn(4, 2), torch.zeros(4).long())
    return metric


def test_indices_count_a_repeated_sample_once():
    embeddings, labels = clustered(samples=200)
    repeated = torch.cat([torch.arange(200), torch.tensor([0, 1, 5])])  # a sampler's padding repeats the first
    metric = KNNRetrieval(chunk_size=30)
    metric.update(embeddings[repeated], labels[repeated], indices=repeated)
    assert metric.compute() == pytest.approx(retrieval_metrics(embeddings, labels), abs=1e-12)
    separate = KNNRetrieval()
    separate.update(embeddings[repeated[:60]], labels[repeated[:60]], indices=repeated[:60])
    separate.update(embeddings[:60], labels[:60], indices=torch.arange(60))  # the same queries again
    references = torch.cat([torch.arange(60, 200), torch.tensor([60, 61])])
    separate.update(embeddings[references], labels[references], reference=True, indices=references)
    expected = retrieval_metrics(embeddings[:60], labels[:60], embeddings[60:], labels[60:])
    assert separate.compute() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: KNNRetrieval(metric="dot"), "Unknown `metric`='dot'"),
        (lambda: KNNRetrieval(backend="annoy"), "Unknown `backend`='annoy'"),
        (lambda: KNNRetrieval(metric=None), "Unknown `metric`=None; valid choices: cosine, euclidean"),
        (lambda: KNNRetrieval(chunk_size=0), "`chunk_size` must be an integer ≥ 1, got 0"),
        (lambda: KNNRetrieval(chunk_size=-5), "`chunk_size` must be an integer ≥ 1, got -5"),
        (lambda: KNNRetrieval(max_memory=-1), "`max_memory` must be a number > 0, got -1"),
        (lambda: KNNRetrieval(max_memory=0.5), "`max_memory`=0 must be a positive number of bytes"),
        (lambda: KNNRetrieval(embeddings_on_cpu="maybe"), r"`embeddings_on_cpu` must be true or false, got 'maybe'"),
        (lambda: KNNRetrieval().update(torch.randn(4, 2), torch.zeros(3)), r"\[4, 2\] and `labels` \[3\]"),
        (lambda: KNNRetrieval().compute(), "before any update"),
        (
            lambda: KNNRetrieval().update(torch.randn(4, 2), torch.zeros(4)),
            "integer class ids, got dtype torch.float32",
        ),
        (
            lambda: KNNRetrieval().update(torch.randn(4, 2), torch.zeros(4).long(), indices=torch.arange(3)),
            r"`indices` \[3\] \(torch.int64\) must be \[B\] integer",
        ),  # fmt: skip
        (lambda: mixed_indices().compute(), "`indices` were given with some query updates and not others"),
        (lambda: two_sizes().compute(), "embeddings of sizes 2 and 3 .over all updates and ranks."),
        (lambda: with_nan().compute(), "KNNRetrieval got NaN embeddings"),
    ],
)
def test_bad_input(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": "512"}, r"`chunk_size` must be an integer ≥ 1, got '512' \(str\)"),
        ({"chunk_size": True}, r"`chunk_size` must be an integer ≥ 1, got True \(bool\)"),
        ({"max_memory": "1GB"}, r"`max_memory` must be a number > 0, got '1GB' \(str\)"),
    ],
)
def test_options_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        KNNRetrieval(**kwargs)


def test_options_from_a_config_are_read_in_their_types():
    metric = KNNRetrieval(chunk_size=64.0, max_memory=1.0e9, embeddings_on_cpu="off")
    assert (metric.chunk_size, metric.max_memory, metric.embeddings_on_cpu) == (64, 10**9, False)
    assert isinstance(metric.max_memory, int) and KNNRetrieval(embeddings_on_cpu="on").embeddings_on_cpu is True


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_give_the_single_process_result(tmp_path):
    result = run_script(Path(__file__).with_name("metrics_ddp_run.py"), [str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    embeddings, labels = clustered(samples=301)  # uneven shards: 151 and 150
    single = retrieval_metrics(embeddings, labels)
    for rank in ranks:
        assert rank["retrieval"] == pytest.approx(single, abs=1e-12)
        separate = retrieval_metrics(embeddings[:101], labels[:101], embeddings[101:], labels[101:])
        assert rank["separate"] == pytest.approx(separate, abs=1e-12)
        assert rank["one_sided"] == pytest.approx(separate, abs=1e-12)
        assert rank["padded"] == pytest.approx(single, abs=1e-12)  # the repeated sample counted once
        assert rank["lonely"] == pytest.approx(retrieval_metrics(embeddings[:151], labels[:151]), abs=1e-12)
        assert "`indices` were given with some query updates and not others" in rank["mixed"]
        pairs = torch.arange(300)  # the ranks took every other pair; their indices restore this order
        single_verification = FaceVerification(folds=5, far_targets=(0.1,))
        single_verification.update(
            embeddings[pairs],
            embeddings[(pairs + 7) % 301],
            first_labels=labels[pairs],
            second_labels=labels[(pairs + 7) % 301],
        )
        assert rank["verification"] == pytest.approx(single_verification.compute(), abs=1e-12)
        rank_zero_pairs = FaceVerification(folds=5, far_targets=(0.1,))
        even = torch.arange(0, 300, 2)
        rank_zero_pairs.update(embeddings[even], embeddings[(even + 7) % 301], first_labels=labels[even],
                               second_labels=labels[(even + 7) % 301])  # fmt: skip
        assert rank["lonely_pairs"] == pytest.approx(rank_zero_pairs.compute(), abs=1e-12)


def test_a_budget_caps_a_given_chunk_and_sync_options_are_refused():
    embeddings, labels = clustered(samples=1000, classes=20, dim=16)
    metric = KNNRetrieval(chunk_size=1000, max_memory=200_000)
    metric.update(embeddings, labels)
    tracker = MemoryTracker()
    with tracker:
        metric.compute()
    assert tracker.peak.total_bytes < 200_000 + 1000 * 16 * 4 * 2 + 1000 * 8 * 4  # not 1000 × 1000 × 4
    with pytest.raises(ValueError, match="leave `sync_on_compute` and `dist_sync_on_step` unset"):
        KNNRetrieval(sync_on_compute=True)
