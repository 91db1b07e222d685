"""Exact k-nearest-neighbour search in bounded memory: query chunks against the whole reference set."""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_memopt.arguments import check_bool, check_float, check_int, check_optional_int
from lightning_memopt.vocabulary import GIB

METRICS = ("cosine", "euclidean")
DistanceMetric = Literal["cosine", "euclidean"]  # == METRICS
BACKENDS = ("torch", "faiss")
SearchBackend = Literal["torch", "faiss"]  # == BACKENDS
DEFAULT_MEMORY = GIB  # bytes of scores per chunk when neither a chunk nor a budget is given
_EPS = 1e-12


def chunk_rows(num_references: int, k: int, max_memory: int) -> int:
    """Query rows per chunk so that a chunk's scores and top-k fit in ``max_memory`` bytes.

    Example::

        >>> chunk_rows(num_references=100_000, k=10, max_memory=2**30)  # 1 GiB: 1787 queries at a time
        1787
    """
    if max_memory <= 0:
        raise ValueError(f"`max_memory`={max_memory!r} must be a positive number of bytes")
    # fp32 scores, ≤ 2 bytes a score for settling ties (see _top_k), the top k + 1 (values, indices) while sorted
    per_row = 6 * num_references + 48 * (k + 1)
    return max(1, int(max_memory) // per_row)


def check_search_options(
    metric: str, backend: str, chunk_size: int | None, max_memory: int | None
) -> tuple[int | None, int | None]:
    """``(chunk_size, max_memory)`` as ints; raise naming the first bad search option.

    Raises:
        ValueError: an unknown metric or backend, a chunk size below 1 or a memory budget ≤ 0.
        TypeError: a chunk size or memory budget that is no number (``"abc"``, ``True``).

    Example::

        >>> check_search_options("cosine", "torch", None, 1e9)
        (None, 1000000000)
    """
    if not isinstance(metric, str) or metric not in METRICS:
        raise ValueError(f"Unknown `metric`={metric!r}; valid choices: {', '.join(METRICS)}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"Unknown `backend`={backend!r}; valid choices: {', '.join(BACKENDS)}")
    chunk_size = check_optional_int("chunk_size", chunk_size, minimum=1)
    if max_memory is not None:  # bytes: 1e9 from a config is a count too
        max_memory = int(check_float("max_memory", max_memory, minimum=0, open_minimum=True))
        chunk_rows(1, 1, max_memory)  # raises for a budget below one byte
    return chunk_size, max_memory


def check_embeddings(query: torch.Tensor, reference: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``query`` and ``reference`` are ``[Q, D]`` and ``[N, D]`` with the same ``D``."""
    if query.dim() != 2 or reference.dim() != 2 or query.shape[1] != reference.shape[1]:
        raise ValueError(
            f"`query` {list(query.shape)} and `reference` {list(reference.shape)} must be [Q, D] and [N, D] "
            "with the same D"
        )


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
    chunk_size, max_memory = check_search_options(metric, backend, chunk_size, max_memory)
    check_embeddings(query, reference)
    exclude_self = check_bool("exclude_self", exclude_self)
    available = reference.shape[0] - (1 if exclude_self else 0)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= available:
        raise ValueError(f"`k`={k!r} must be an int in [1, {available}] ({reference.shape[0]} references)")
    query_offset = check_int("query_offset", query_offset, minimum=0)
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
    index = ExactIndex(reference, metric, backend)
    found = [
        index.search(query[start : start + chunk_size], k, exclude_self, query_offset + start)
        for start in range(0, query.shape[0], chunk_size)
    ]
    return torch.cat([scores for scores, _ in found]), torch.cat([indices for _, indices in found])


class ExactIndex:
    """A reference set prepared once (norms, or a flat faiss index) for exact searches of many query chunks.

    ``search`` scores its whole query chunk at once (``Q × N`` fp32): split large query sets, as
    :func:`knn` does.

    Example::

        >>> index = ExactIndex(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        >>> index.search(torch.tensor([[1.0, 0.1]]), k=2)[1].tolist()
        [[0, 2]]
    """

    def __init__(self, reference: torch.Tensor, metric: str = "cosine", backend: str = "torch") -> None:
        check_search_options(metric, backend, None, None)
        self.metric, self.backend, self.size = metric, backend, reference.shape[0]
        if backend == "faiss":
            self.faiss_index = _faiss_index(reference, metric)
            return
        self.reference = reference.float()  # fp32 scores, whatever the embeddings' dtype
        self.reference_sq = self.reference.pow(2).sum(dim=1)
        if metric == "cosine":
            self.reference_sq = self.reference_sq.sqrt_().clamp_min_(_EPS)  # the norms, divided out of the dots

    def search(
        self, query: torch.Tensor, k: int, exclude_self: bool = False, query_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, indices)`` ``[Q, k]`` of ``query`` (one chunk); arguments as in :func:`knn`."""
        if self.backend == "faiss":
            return self._faiss_search(query, k, exclude_self, query_offset)
        similarity = _similarity(query.float(), self.reference, self.reference_sq, self.metric)  # larger is nearer
        if exclude_self:
            rows = torch.arange(query.shape[0], device=similarity.device)
            similarity[rows, rows + query_offset] = -torch.inf
        values, indices = _top_k(similarity, k)
        del similarity
        return (values if self.metric == "cosine" else values.neg_().clamp_min_(0).sqrt_()), indices

    def _faiss_search(
        self, query: torch.Tensor, k: int, exclude_self: bool, query_offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        extra = 1 if exclude_self else 0
        queries = _faiss_ready(query, self.metric)
        scores, indices = (torch.from_numpy(a) for a in self.faiss_index.search(queries.numpy(), k + extra))
        if exclude_self:
            own = torch.arange(query_offset, query_offset + query.shape[0])[:, None]
            keep = indices != own
            keep[keep.all(dim=1), -1] = False  # its own entry was not among the k + 1: drop the last
            scores, indices = scores[keep].view(-1, k), indices[keep].view(-1, k)
        if self.metric == "euclidean":
            scores = scores.clamp_min_(0).sqrt_()  # faiss gives squared distances
        return scores.to(query.device), indices.to(query.device)


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
        tied = torch.nonzero(values[:, k] == values[:, k - 1]).flatten()
        block = max(1, similarity.shape[0] // 8)  # ≤ 13 bytes a score (row copy, masks, counts): an eighth at a time
        for start in range(0, tied.numel(), block):
            rows = tied[start : start + block]
            values[rows, :k], indices[rows, :k] = _lowest_index_top_k(similarity[rows], values[rows, k - 1], k)
        values, indices = values[:, :k], indices[:, :k]
    # within the k, equal values in index order: sort by index, then stably by value
    by_index = indices.argsort(dim=1)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, by_value), indices.gather(1, by_value)


def _lowest_index_top_k(similarity: torch.Tensor, kth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' top ``k`` given their ``k``-th value: all above it, then the lowest indices equal to it."""
    above = similarity > kth[:, None]
    equal = similarity == kth[:, None]
    wanted = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    chosen = above | (equal & (equal.cumsum(dim=1, dtype=torch.int32) <= wanted))
    indices = torch.nonzero(chosen)[:, 1].view(-1, k)  # row-major: k ascending indices per row
    return similarity.gather(1, indices), indices


def _faiss_ready(embeddings: torch.Tensor, metric: str) -> torch.Tensor:
    """fp32 CPU rows for faiss, unit length for cosine."""
    rows = embeddings.detach().float().cpu()
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(_EPS) if metric == "cosine" else rows


def _faiss_index(reference: torch.Tensor, metric: str) -> Any:
    try:
        import faiss
    except ImportError:
        raise ValueError("`backend`='faiss' needs faiss: pip install 'lightning-memopt[faiss]'") from None
    dimension = reference.shape[1]
    index = faiss.IndexFlatIP(dimension) if metric == "cosine" else faiss.IndexFlatL2(dimension)
    index.add(_faiss_ready(reference, metric).numpy())
    return index
