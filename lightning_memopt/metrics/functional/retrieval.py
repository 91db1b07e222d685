"""Retrieval accuracy from exact kNN, as pytorch-metric-learning defines it: precision@1, R-precision, MAP@R."""

from __future__ import annotations

import torch

from lightning_memopt.metrics.functional.knn import (
    DEFAULT_MEMORY,
    ExactIndex,
    check_embeddings,
    check_search_options,
    chunk_rows,
)

RETRIEVAL_METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


def retrieval_sums(
    query: torch.Tensor,
    query_labels: torch.Tensor,
    reference: torch.Tensor,
    reference_labels: torch.Tensor,
    *,
    same_set: bool,
    query_offset: int = 0,
    metric: str = "cosine",
    chunk_size: int | None = None,
    max_memory: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Per-query sums ``[precision@1, R-precision, MAP@R, queries counted]`` (fp64), chunk by chunk.

    R is the number of references with the query's label (the query itself excluded when
    ``same_set``, where query ``i`` is reference ``query_offset + i``). Queries with R = 0 are left
    out. Each query chunk searches its own largest R neighbours, so memory stays
    ``chunk × N_ref``. Sums (not means) let shards of the queries be added across ranks.

    Raises:
        ValueError: for embeddings that are not ``[Q, D]`` and ``[N, D]``, labels that do not match
            them in length, or a bad search option.
    """
    check_search_options(metric, backend, chunk_size, max_memory)
    check_embeddings(query, reference)
    for name, embeddings, labels in (("query", query, query_labels), ("reference", reference, reference_labels)):
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"`{name}_labels` {list(labels.shape)} must give one label per {name} embedding ({embeddings.shape[0]})"
            )
    sums = torch.zeros(4, dtype=torch.float64)
    if query.shape[0] == 0 or reference.shape[0] == 0:
        return sums
    classes, counts = torch.unique(reference_labels, return_counts=True)
    query_labels = query_labels.to(reference_labels.dtype)
    position = torch.searchsorted(classes, query_labels).clamp_max(classes.numel() - 1)
    found = classes[position] == query_labels
    relevant = torch.where(found, counts[position], 0) - (1 if same_set else 0)  # R per query
    largest_r = int(relevant.max().clamp_min(1))
    if chunk_size is None or max_memory is not None:  # a budget caps a given chunk too
        budget = DEFAULT_MEMORY if max_memory is None else max_memory
        derived = chunk_rows(reference.shape[0], largest_r, budget)
        chunk_size = derived if chunk_size is None else min(chunk_size, derived)
    index = ExactIndex(reference, metric, backend)
    for start in range(0, query.shape[0], chunk_size):
        r = relevant[start : start + chunk_size]
        keep = r > 0
        if not keep.any():
            continue
        _, neighbours = index.search(query[start : start + chunk_size], int(r.max()), same_set, query_offset + start)
        hits = reference_labels[neighbours[keep]] == query_labels[start : start + chunk_size][keep, None]
        sums += _chunk_sums(hits, r[keep])
    return sums


def _chunk_sums(hits: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """``hits`` ``[q, k]`` (neighbour has the query's label), ``relevant`` ``[q]`` (R) → the four sums."""
    k = hits.shape[1]
    rank = torch.arange(1, k + 1, device=hits.device)
    within = rank[None, :] <= relevant[:, None]  # the first R neighbours only
    hits = hits & within
    precision_at_1 = hits[:, 0].double()
    r_precision = hits.sum(dim=1).double() / relevant.double()
    precision_at_i = hits.cumsum(dim=1).double() / rank[None, :].double()
    average_precision = (precision_at_i * hits).sum(dim=1) / relevant.double()
    return torch.stack(
        [precision_at_1.sum(), r_precision.sum(), average_precision.sum(), precision_at_1.new_tensor(hits.shape[0])]
    ).cpu()


def retrieval_metrics(
    query: torch.Tensor,
    query_labels: torch.Tensor,
    reference: torch.Tensor | None = None,
    reference_labels: torch.Tensor | None = None,
    *,
    metric: str = "cosine",
    chunk_size: int | None = None,
    max_memory: int | None = None,
    backend: str = "torch",
) -> dict[str, float]:
    """precision@1, R-precision and MAP@R of ``query`` against ``reference`` (default: the queries themselves).

    Raises:
        ValueError: for mismatched lengths, or when no query has another reference of its label.

    Example::

        >>> embeddings = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> retrieval_metrics(embeddings, torch.tensor([0, 0, 1, 1]))["precision_at_1"]
        1.0
    """
    same_set = reference is None
    if same_set:
        reference, reference_labels = query, query_labels
    elif reference_labels is None:
        raise ValueError("`reference_labels` must be given with `reference`")
    assert reference is not None and reference_labels is not None
    sums = retrieval_sums(
        query,
        query_labels,
        reference,
        reference_labels,
        same_set=same_set,
        metric=metric,
        chunk_size=chunk_size,
        max_memory=max_memory,
        backend=backend,
    )
    return metrics_from_sums(sums)


def metrics_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """The three means from :func:`retrieval_sums` (added over ranks, if sharded)."""
    count = float(sums[3])
    if count == 0:
        raise ValueError("no query has another reference with its label: retrieval metrics are undefined")
    return {name: float(value) / count for name, value in zip(RETRIEVAL_METRICS, sums[:3].tolist(), strict=True)}
