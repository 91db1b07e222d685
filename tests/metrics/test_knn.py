import importlib

import pytest
import torch

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.metrics.functional.knn import chunk_rows, knn


def brute_force(query, reference, k, metric, exclude_self=False, offset=0):
    """Every score, then sorted by (nearer first, lower index first)."""
    if metric == "cosine":
        q = query / query.norm(dim=1, keepdim=True)
        r = reference / reference.norm(dim=1, keepdim=True)
        scores = q.double() @ r.double().T
    else:
        scores = -torch.cdist(query.double(), reference.double())
    if exclude_self:
        for i in range(query.shape[0]):
            scores[i, offset + i] = -torch.inf
    results = []
    for row in scores:
        order = sorted(range(reference.shape[0]), key=lambda j: (-row[j].item(), j))[:k]
        results.append(order)
    return torch.tensor(results)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_matches_brute_force(metric, chunk_size):
    generator = torch.Generator().manual_seed(0)
    query, reference = torch.randn(40, 8, generator=generator), torch.randn(50, 8, generator=generator)
    scores, indices = knn(query, reference, 5, metric=metric, chunk_size=chunk_size)
    assert torch.equal(indices, brute_force(query, reference, 5, metric))
    if metric == "cosine":
        expected = torch.nn.functional.cosine_similarity(query[:, None], reference[indices], dim=2)
    else:
        expected = (query[:, None] - reference[indices]).norm(dim=2)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_exclude_self_with_an_offset():
    reference = torch.randn(30, 4, generator=torch.Generator().manual_seed(1))
    _, indices = knn(reference[10:20], reference, 3, exclude_self=True, query_offset=10, chunk_size=4)
    assert torch.equal(indices, brute_force(reference[10:20], reference, 3, "cosine", exclude_self=True, offset=10))
    assert not (indices == torch.arange(10, 20)[:, None]).any()


def test_ties_go_to_the_lower_index():
    reference = torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 1.0]] * 3)
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    _, indices = knn(query, reference, 4, chunk_size=2)
    assert indices.tolist() == [[0, 1, 2, 3], [3, 4, 5, 0], [0, 1, 2, 3]]
    _, indices = knn(reference, reference, 2, exclude_self=True)
    assert indices.tolist() == [[1, 2], [0, 2], [0, 1], [4, 5], [3, 5], [3, 4]]
    _, euclidean = knn(query, reference, 4, metric="euclidean")
    assert torch.equal(euclidean, brute_force(query, reference, 4, "euclidean"))


def test_collapsed_embeddings_tie_everywhere_and_stay_fast_and_bounded():
    """An untrained model's identical embeddings: every row ties across the k-th place."""
    reference = torch.ones(3000, 8)
    reference[::7] = -1.0  # two clusters of exact ties
    tracker = MemoryTracker()
    with tracker:
        scores, indices = knn(reference, reference, 5, chunk_size=500, exclude_self=True)
    first_plain = [j for j in range(3000) if j % 7][:6]
    first_flipped = list(range(0, 3000, 7))[:6]
    for row in (0, 1, 7, 2999):
        expected = first_flipped if row % 7 == 0 else first_plain
        assert indices[row].tolist() == [j for j in expected if j != row][:5]
    assert torch.equal(indices[:50], brute_force(reference[:50], reference, 5, "cosine", exclude_self=True))
    outputs = scores.numel() * 4 + indices.numel() * 8
    assert tracker.peak.total_bytes - outputs <= 500 * 3000 * 6 + 3000 * 8 * 4 * 2  # the budget chunk_rows assumes


def test_memory_stays_a_chunk_of_scores():
    generator = torch.Generator().manual_seed(2)
    reference = torch.randn(2000, 16, generator=generator)
    full = 2000 * 2000 * 4
    tracker = MemoryTracker()
    with tracker:
        scores, indices = knn(reference, reference, 10, chunk_size=100, exclude_self=True)
    outputs = scores.numel() * 4 + indices.numel() * 8
    extra = tracker.peak.total_bytes - outputs
    assert extra <= 5 * 100 * 2000 + 12 * 100 * 10 + 2000 * 4 + 100 * 16 * 4 * 2 + 2 * outputs  # a chunk + norms
    assert extra < full / 10


def test_max_memory_derives_the_chunk():
    reference = torch.randn(1000, 8, generator=torch.Generator().manual_seed(3))
    budget = 400_000
    tracker = MemoryTracker()
    with tracker:
        scores, indices = knn(reference, reference, 5, max_memory=budget)
    chunk = chunk_rows(1000, 5, budget)
    assert chunk == 63
    assert tracker.peak.total_bytes <= budget + scores.numel() * 12 * 2 + 1000 * 4 + chunk * 8 * 4 * 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"k": 0}, r"`k`=0 must be an int in \[1, 5\]"),
        ({"k": 5, "exclude_self": True}, r"`k`=5 must be an int in \[1, 4\]"),
        ({"metric": "dot"}, "Unknown `metric`='dot'; valid choices: cosine, euclidean"),
        ({"backend": "annoy"}, "Unknown `backend`='annoy'; valid choices: torch, faiss"),
        ({"chunk_size": 0}, "`chunk_size` must be an integer ≥ 1, got 0"),
        ({"max_memory": 0}, "`max_memory` must be a number > 0, got 0"),
        ({"query_offset": -1}, "`query_offset` must be an integer ≥ 0, got -1"),
        ({"exclude_self": "maybe"}, "`exclude_self` must be true or false, got 'maybe'"),
        ({"exclude_self": True, "query_offset": 3}, "queries 3…7 are not all in the 5 references"),
    ],
)
def test_bad_input(arguments, message):
    arguments = {"k": 2, **arguments}
    with pytest.raises(ValueError, match=message):
        knn(torch.randn(5, 3), torch.randn(5, 3), **arguments)
    with pytest.raises(ValueError, match=r"\[5, 3\] and `reference` \[5, 4\]"):
        knn(torch.randn(5, 3), torch.randn(5, 4), 2)


def test_faiss_gives_the_same_neighbours():
    pytest.importorskip("faiss")
    generator = torch.Generator().manual_seed(4)
    reference = torch.randn(200, 32, generator=generator)
    for metric in ("cosine", "euclidean"):
        ours = knn(reference, reference, 5, metric=metric, exclude_self=True)
        theirs = knn(reference, reference, 5, metric=metric, exclude_self=True, backend="faiss")
        assert torch.equal(ours[1], theirs[1])
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-4)


def test_faiss_index_is_built_once_for_all_chunks(monkeypatch):
    pytest.importorskip("faiss")
    knn_module = importlib.import_module("lightning_memopt.metrics.functional.knn")  # the package exports knn()
    from lightning_memopt.metrics.functional.retrieval import retrieval_sums

    built = []
    original = knn_module._faiss_index
    monkeypatch.setattr(knn_module, "_faiss_index", lambda *args: built.append(1) or original(*args))
    reference = torch.randn(120, 16, generator=torch.Generator().manual_seed(7))
    labels = torch.arange(120) % 6
    torch_sums = retrieval_sums(reference, labels, reference, labels, same_set=True, chunk_size=10)
    faiss_sums = retrieval_sums(reference, labels, reference, labels, same_set=True, chunk_size=10, backend="faiss")
    assert len(built) == 1  # one index, twelve chunks
    torch.testing.assert_close(faiss_sums, torch_sums, rtol=0, atol=1e-12)


def test_empty_queries_and_half_precision_embeddings():
    reference = torch.randn(20, 8, generator=torch.Generator().manual_seed(5))
    scores, indices = knn(reference[:0], reference, 3)
    assert scores.shape == indices.shape == (0, 3)
    half_scores, half_indices = knn(reference.bfloat16(), reference.bfloat16(), 3, exclude_self=True)
    assert half_scores.dtype == torch.float32  # scored in fp32
    assert torch.equal(
        half_indices, knn(reference.bfloat16().float(), reference.bfloat16().float(), 3, exclude_self=True)[1]
    )
    with pytest.raises(ValueError, match="`query_offset` must be an integer ≥ 0, got -1"):
        knn(reference, reference, 2, query_offset=-1)
    with pytest.raises(TypeError, match=r"`query_offset` must be an integer ≥ 0, got '3' \(str\)"):
        knn(reference, reference, 2, query_offset="3")
    with pytest.raises(TypeError, match=r"`chunk_size` must be an integer ≥ 1, got '8' \(str\)"):
        knn(reference, reference, 2, chunk_size="8")


@pytest.mark.cuda
def test_retrieval_on_cuda_matches_the_cpu():
    from lightning_memopt.metrics import KNNRetrieval

    generator = torch.Generator().manual_seed(6)
    embeddings, labels = torch.randn(300, 16, generator=generator), torch.randint(0, 10, (300,), generator=generator)
    values = []
    for device in ("cpu", "cuda"):
        metric = KNNRetrieval().to(device)
        metric.update(embeddings.to(device), labels.to(device))
        values.append(metric.compute())
    assert values[1] == pytest.approx(values[0], abs=1e-9)
