"""KNNRetrieval: precision@1, R-precision and MAP@R by exact kNN, in bounded memory, sharded under DDP."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_memopt.metrics.functional.knn import check_search_options
from lightning_memopt.metrics.functional.retrieval import metrics_from_sums, retrieval_sums


class KNNRetrieval(Metric):
    """Retrieval accuracy of embeddings, with pytorch-metric-learning's definitions.

    ``update(embeddings, labels)`` adds queries; ``update(..., reference=True)`` adds a separate
    reference set. Without any, the queries are their own references and each query is left out
    of its own neighbours. Queries whose label has no other reference are skipped.

    Under DDP each rank keeps its own queries. ``compute`` gathers the reference set (``N × D``) and
    searches its own queries against it, one chunk at a time (``chunk × N`` scores). It then adds
    the per-query sums over the ranks, so no rank ever holds ``N × N`` or another rank's queries'
    neighbours.

    Args:
        metric: ``"cosine"`` or ``"euclidean"``.
        chunk_size: queries per chunk; ``max_memory``: bytes for a chunk's scores (derives the chunk).
        embeddings_on_cpu: keep the stored embeddings in host memory (and search there).
        backend: ``"torch"``, or ``"faiss"`` (exact flat index, extra ``faiss``).

    Raises:
        ValueError: for an unknown ``metric`` / ``backend``, a bad ``chunk_size`` / ``max_memory``,
            mismatched lengths in ``update``, or ``compute`` with no usable query.

    Example::

        >>> metric = KNNRetrieval()
        >>> metric.update(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.2, 0.8]]), torch.tensor([0, 0, 1, 1]))
        >>> {name: round(value, 3) for name, value in metric.compute().items()}
        {'precision_at_1': 1.0, 'r_precision': 1.0, 'mean_average_precision_at_r': 1.0}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    query_embeddings: list[torch.Tensor]
    query_labels: list[torch.Tensor]
    reference_embeddings: list[torch.Tensor]
    reference_labels: list[torch.Tensor]

    def __init__(
        self,
        metric: str = "cosine",
        chunk_size: int | None = None,
        max_memory: int | None = None,
        embeddings_on_cpu: bool = False,
        backend: str = "torch",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("sync_on_compute") or kwargs.get("dist_sync_on_step"):
            raise ValueError(
                "KNNRetrieval synchronises in compute itself (references gathered, queries kept per rank): "
                "leave `sync_on_compute` and `dist_sync_on_step` unset"
            )
        super().__init__(**{**kwargs, "sync_on_compute": False})
        check_search_options(metric, backend, chunk_size, max_memory)
        self.metric, self.chunk_size, self.max_memory = metric, chunk_size, max_memory
        self.embeddings_on_cpu, self.backend = embeddings_on_cpu, backend
        for name in ("query_embeddings", "query_labels", "reference_embeddings", "reference_labels"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, embeddings: torch.Tensor, labels: torch.Tensor, reference: bool = False) -> None:
        """Add ``[B, D]`` ``embeddings`` with ``[B]`` ``labels`` as queries, or as references."""
        if embeddings.dim() != 2 or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"`embeddings` {list(embeddings.shape)} and `labels` {list(labels.shape)} must be [B, D] and [B]"
            )
        embeddings, labels = embeddings.detach().float(), labels.detach()  # fp32 scores, also after bf16 steps
        if self.embeddings_on_cpu:
            embeddings, labels = embeddings.cpu(), labels.cpu()
        prefix = "reference" if reference else "query"
        getattr(self, f"{prefix}_embeddings").append(embeddings)
        getattr(self, f"{prefix}_labels").append(labels)

    def compute(self) -> dict[str, float]:
        if not self.query_embeddings:
            raise ValueError("KNNRetrieval.compute() before any update: there are no query embeddings")
        queries, query_labels = dim_zero_cat(self.query_embeddings), dim_zero_cat(self.query_labels)
        same_set = not self.reference_embeddings
        if same_set:
            references, reference_labels = queries, query_labels
        else:
            references = dim_zero_cat(self.reference_embeddings)
            reference_labels = dim_zero_cat(self.reference_labels)
        offset = 0
        distributed = self._distributed()
        if distributed:
            shards = gather_all_tensors(references, group=self.process_group)
            reference_labels = torch.cat(gather_all_tensors(reference_labels, group=self.process_group))
            rank = torch.distributed.get_rank(self.process_group)
            offset = sum(shard.shape[0] for shard in shards[:rank])  # where this rank's queries sit among them
            references = torch.cat(shards)
        sums = retrieval_sums(
            queries,
            query_labels,
            references,
            reference_labels,
            same_set=same_set,
            query_offset=offset,
            metric=self.metric,
            chunk_size=self.chunk_size,
            max_memory=self.max_memory,
            backend=self.backend,
        )
        if distributed:
            sums = sums.to(self.device)
            torch.distributed.all_reduce(sums, group=self.process_group)
        return metrics_from_sums(sums.cpu())

    def _distributed(self) -> bool:
        return (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and (torch.distributed.get_world_size(self.process_group) > 1)
        )
