"""Exact k-nearest-neighbour search in bounded memory: query chunks against the whole reference set."""

from __future__ import annotations

import torch

METRICS = ("cosine", "euclidean")
BACKENDS = ("torch", "faiss")
DEFAULT_MEMORY = 2**30  # bytes of scores per chunk when neither a chunk nor a budget is given
_EPS = 1e-12


def chunk_rows(num_references: int, k: int, max_memory: int) -> int:
    """Query rows per chunk so that a chunk's scores and top-k fit in ``max_memory`` bytes.

    Example::

        >>> chunk_rows(num_references=100_000, k=10, max_memory=2**30)  # 1 GiB: 2680 queries at a time
        2680
    """
    if max_memory <= 0:
        raise ValueError(f"`max_memory`={max_memory!r} must be a positive number of bytes")
    per_row = 4 * num_references + 48 * (k + 1)  # fp32 scores; the top k + 1 (values, indices) while sorted
    return max(1, int(max_memory) // per_row)


def check_search_options(metric: str, backend: str, chunk_size: int | None, max_memory: int | None) -> None:
    """Raise ``ValueError`` naming the first bad search option: metric, backend, chunk size or memory budget."""
    if metric not in METRICS:
        raise ValueError(f"Unknown `metric`={metric!r}; valid choices: {', '.join(METRICS)}")
    if backend not in BACKENDS:
        raise ValueError(f"Unknown `backend`={backend!r}; valid choices: {', '.join(BACKENDS)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"`chunk_size`={chunk_size!r} must be an int ≥ 1")
    if max_memory is not None:
        chunk_rows(1, 1, max_memory)  # raises for a non-positive budget


def knn(
    query: torch.Tensor,
    reference: torch.Tensor,
    k: int,
    metric: str = "cosine",
    chunk_size: int | None = None,
    max_memory: int | None = None,
    exclude_self: bool = False,
    query_offset: int = 0,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest references of every query, exact, computed query chunk by query chunk.

    The extra memory at any time is one chunk's score matrix (``chunk × N_ref`` fp32) plus the
    reference norms, never ``N_query × N_ref``. ``chunk_size`` sets the chunk; ``max_memory``
    (bytes) derives it; neither: a 1 GiB budget. Ties go to the lower reference index, so results
    are deterministic.

    Args:
        query: ``[Q, D]`` embeddings.
        reference: ``[N, D]`` embeddings.
        k: neighbours per query.
        metric: ``"cosine"`` (similarities, largest first) or ``"euclidean"`` (distances, smallest first).
        chunk_size: queries per chunk.
        max_memory: bytes for a chunk's scores and top-k, from which the chunk is derived.
        exclude_self: query ``i`` is reference ``query_offset + i`` and is not its own neighbour.
        query_offset: where the queries start in the reference set (a rank's shard under DDP).
        backend: ``"torch"``, or ``"faiss"`` (exact ``IndexFlatIP`` / ``IndexFlatL2`` on the CPU; needs
            ``faiss-cpu``, extra ``faiss``; its order among exactly tied scores is its own).

    Returns:
        ``(scores, indices)``, each ``[Q, k]``: cosine similarities or euclidean distances, and
        reference indices.

    Raises:
        ValueError: for tensors that are not ``[*, D]`` alike, an unknown metric, ``k`` < 1 or
            more than the references available, a bad ``chunk_size`` or ``max_memory``.

    Example::

        >>> reference = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        >>> scores, indices = knn(reference, reference, k=1, exclude_self=True)
        >>> indices.flatten().tolist()  # [1, 0] and [0, 1] tie for the third: the lower index wins
        [2, 2, 0]
    """
    check_search_options(metric, backend, chunk_size, max_memory)
    if query.dim() != 2 or reference.dim() != 2 or query.shape[1] != reference.shape[1]:
        raise ValueError(
            f"`query` {list(query.shape)} and `reference` {list(reference.shape)} must be [Q, D] and [N, D] "
            "with the same D"
        )
    available = reference.shape[0] - (1 if exclude_self else 0)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= available:
        raise ValueError(f"`k`={k!r} must be an int in [1, {available}] ({reference.shape[0]} references)")
    if query_offset < 0:
        raise ValueError(f"`query_offset`={query_offset!r} must be ≥ 0")
    if query.shape[0] == 0:
        return query.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long, device=query.device)
    if exclude_self and query_offset + query.shape[0] > reference.shape[0]:
        raise ValueError(
            f"`exclude_self` with `query_offset`={query_offset}: queries {query_offset}…"
            f"{query_offset + query.shape[0] - 1} are not all in the {reference.shape[0]} references"
        )
    if chunk_size is None:
        chunk_size = chunk_rows(reference.shape[0], k, DEFAULT_MEMORY if max_memory is None else max_memory)
    elif max_memory is not None:
        chunk_size = min(chunk_size, chunk_rows(reference.shape[0], k, max_memory))
    if backend == "faiss":
        return _faiss_knn(query, reference, k, metric, exclude_self, query_offset)
    query, reference = query.float(), reference.float()  # fp32 scores, whatever the embeddings' dtype
    reference_sq = reference.pow(2).sum(dim=1)
    if metric == "cosine":
        reference_sq = reference_sq.sqrt_().clamp_min_(_EPS)  # the norms, divided out of the dot products
    scores, indices = [], []
    for start in range(0, query.shape[0], chunk_size):
        chunk = query[start : start + chunk_size]
        similarity = _similarity(chunk, reference, reference_sq, metric)  # larger is nearer
        if exclude_self:
            rows = torch.arange(chunk.shape[0], device=similarity.device)
            similarity[rows, rows + query_offset + start] = -torch.inf
        values, found = _top_k(similarity, k)
        del similarity
        scores.append(values if metric == "cosine" else values.neg_().clamp_min_(0).sqrt_())
        indices.append(found)
    return torch.cat(scores), torch.cat(indices)


def _similarity(chunk: torch.Tensor, reference: torch.Tensor, reference_sq: torch.Tensor, metric: str) -> torch.Tensor:
    """``[chunk, N]``: cosine similarity, or minus the squared euclidean distance, computed in place."""
    if metric == "cosine":
        normed = chunk / chunk.norm(dim=1, keepdim=True).clamp_min(_EPS)
        return (normed @ reference.T).div_(reference_sq)
    dot = chunk @ reference.T
    return dot.mul_(2).sub_(reference_sq).sub_(chunk.pow(2).sum(dim=1, keepdim=True))


def _top_k(similarity: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` per row, largest first, ties to the lower index (``torch.topk`` leaves them open)."""
    extra = 1 if k < similarity.shape[1] else 0
    values, indices = similarity.topk(k + extra, dim=1)
    if extra:  # a (k+1)-th value equal to the k-th: a tie crosses the k-th place, settle it by index
        for row in torch.nonzero(values[:, k] == values[:, k - 1]).flatten().tolist():
            candidates = torch.nonzero(similarity[row] >= values[row, k - 1]).flatten()  # ascending indices
            order = torch.sort(similarity[row, candidates], descending=True, stable=True).indices[:k]
            values[row, :k], indices[row, :k] = similarity[row, candidates[order]], candidates[order]
        values, indices = values[:, :k], indices[:, :k]
    # within the k, equal values in index order: sort by index, then stably by value
    by_index = indices.argsort(dim=1)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, by_value), indices.gather(1, by_value)


def _faiss_knn(
    query: torch.Tensor, reference: torch.Tensor, k: int, metric: str, exclude_self: bool, query_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        import faiss
    except ImportError:
        raise ValueError("`backend`='faiss' needs faiss: pip install 'lightning-memopt[faiss]'") from None
    queries = query.detach().float().cpu()
    references = reference.detach().float().cpu()
    if metric == "cosine":
        queries = queries / queries.norm(dim=1, keepdim=True).clamp_min(_EPS)
        references = references / references.norm(dim=1, keepdim=True).clamp_min(_EPS)
    index = faiss.IndexFlatIP(references.shape[1]) if metric == "cosine" else faiss.IndexFlatL2(references.shape[1])
    index.add(references.numpy())
    extra = 1 if exclude_self else 0
    scores, indices = (torch.from_numpy(a) for a in index.search(queries.numpy(), k + extra))
    if exclude_self:
        own = torch.arange(query_offset, query_offset + query.shape[0])[:, None]
        keep = indices != own
        keep[keep.all(dim=1), -1] = False  # its own entry was not among the k + 1: drop the last
        scores, indices = scores[keep].view(-1, k), indices[keep].view(-1, k)
    if metric == "euclidean":
        scores = scores.clamp_min_(0).sqrt_()  # faiss gives squared distances
    return scores.to(query.device), indices.to(query.device)
