"""KNNRetrieval: precision@1, R-precision and MAP@R by exact kNN, in bounded memory, sharded under DDP."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_memopt.arguments import check_bool
from lightning_memopt.metrics.functional.knn import DistanceMetric, SearchBackend, check_search_options
from lightning_memopt.metrics.functional.retrieval import metrics_from_sums, retrieval_sums
from lightning_memopt.metrics.sharded import (
    communication_device,
    first_occurrence,
    gather_rows,
    is_distributed,
    max_over_ranks,
    rows_per_rank,
)


class KNNRetrieval(Metric):
    """Retrieval accuracy of embeddings, with pytorch-metric-learning's definitions.

    ``update(embeddings, labels)`` adds queries; ``update(..., reference=True)`` adds a separate
    reference set. Without any, the queries are their own references and each query is left out
    of its own neighbours. Queries whose label has no other reference are skipped.

    Under DDP each rank keeps its own queries. ``compute`` gathers the reference set (``N × D``) and
    searches its own queries against it, one chunk at a time (``chunk × N`` scores). It then adds
    the per-query sums over the ranks, so no rank ever holds ``N × N`` or another rank's queries'
    neighbours. The reference shards arrive one at a time on the backend's device (the GPU for
    NCCL) and are kept where the embeddings are kept, so ``embeddings_on_cpu`` works under NCCL.
    A rank without updates takes part with an empty shard.

    A distributed sampler pads the last batches with repeated samples; pass ``indices=`` (the
    samples' dataset positions) to ``update`` and each sample counts once, also as a reference.

    Args:
        metric: ``"cosine"`` or ``"euclidean"``.
        chunk_size: queries per chunk, at least 1; ``None`` derives it from ``max_memory``.
        max_memory: bytes for a chunk's scores, from which the chunk size is derived; ``None``: 1 GiB
            (unless ``chunk_size`` is given).
        embeddings_on_cpu: keep the stored embeddings in host memory (and search there).
        backend: ``"torch"``, or ``"faiss"`` (exact flat index, extra ``faiss``).
        **kwargs: torchmetrics ``Metric`` options (``compute_on_cpu``, ``process_group``, …), except
            ``sync_on_compute`` and ``dist_sync_on_step``: the metric synchronises in ``compute`` itself.

    Raises:
        TypeError: a ``chunk_size`` / ``max_memory`` that is no number.
        ValueError: for an unknown ``metric`` / ``backend``, a bad ``chunk_size`` / ``max_memory``,
            an ``embeddings_on_cpu`` neither a bool nor a word such as ``"on"`` / ``"off"``,
            mismatched lengths or float labels in ``update``, ``indices`` given with some updates only,
            or ``compute`` with no usable query (raised on every rank alike).

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
    query_indices: list[torch.Tensor]
    reference_embeddings: list[torch.Tensor]
    reference_labels: list[torch.Tensor]
    reference_indices: list[torch.Tensor]

    def __init__(
        self,
        metric: DistanceMetric = "cosine",
        chunk_size: int | None = None,
        max_memory: int | None = None,
        embeddings_on_cpu: bool = False,
        backend: SearchBackend = "torch",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("sync_on_compute") or kwargs.get("dist_sync_on_step"):
            raise ValueError(
                "KNNRetrieval synchronises in compute itself (references gathered, queries kept per rank): "
                "leave `sync_on_compute` and `dist_sync_on_step` unset"
            )
        chunk_size, max_memory = check_search_options(metric, backend, chunk_size, max_memory)
        embeddings_on_cpu = check_bool("embeddings_on_cpu", embeddings_on_cpu)  # "off" is false, never truthiness
        super().__init__(**{**kwargs, "sync_on_compute": False})
        self.metric, self.chunk_size, self.max_memory = metric, chunk_size, max_memory
        self.embeddings_on_cpu, self.backend = embeddings_on_cpu, backend
        for prefix in _SETS:
            for part in ("embeddings", "labels", "indices"):
                self.add_state(f"{prefix}_{part}", default=[], dist_reduce_fx="cat")

    def update(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        reference: bool = False,
        indices: torch.Tensor | None = None,
    ) -> None:
        """Add ``[B, D]`` ``embeddings`` with ``[B]`` integer ``labels`` as queries, or as references.

        ``indices`` (``[B]``, the samples' positions in their dataset) let ``compute`` count each
        sample once: a distributed sampler pads the last batches with repeats. Give them in every
        update or in none.
        """
        if embeddings.dim() != 2 or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"`embeddings` {list(embeddings.shape)} and `labels` {list(labels.shape)} must be [B, D] and [B]"
            )
        if labels.is_floating_point() or labels.is_complex():
            raise ValueError(f"`labels` must be integer class ids, got dtype {labels.dtype}")
        if indices is not None and (indices.shape != labels.shape or indices.is_floating_point()):
            raise ValueError(f"`indices` {list(indices.shape)} ({indices.dtype}) must be [B] integer sample positions")
        embeddings, labels = embeddings.detach().float(), labels.detach().long()  # fp32 scores after bf16 steps too
        if self.embeddings_on_cpu:
            embeddings, labels = embeddings.cpu(), labels.cpu()
        prefix = "reference" if reference else "query"
        getattr(self, f"{prefix}_embeddings").append(embeddings)
        getattr(self, f"{prefix}_labels").append(labels)
        if indices is not None:
            getattr(self, f"{prefix}_indices").append(indices.detach().long().to(labels.device))

    def compute(self) -> dict[str, float]:
        group = self.process_group
        device = communication_device(group, self.device) if self._distributed() else None
        dimension, has_references, query_indexed, reference_indexed = self._agree(device)
        queries, query_labels, query_indices = self._local("query", dimension)
        sizes = rows_per_rank(queries.shape[0], group, device)
        offset = sum(sizes[: dist.get_rank(group)]) if self._distributed() else 0  # this rank's first query
        keep = None  # the first copy of each sample counts; a distributed sampler's repeats do not
        if query_indexed:
            keep = first_occurrence(gather_rows(query_indices, sizes, group, device))
        if has_references:
            references, reference_labels, reference_indices = self._local("reference", dimension)
            reference_sizes = rows_per_rank(references.shape[0], group, device)
            reference_keep = None
            if reference_indexed:
                reference_keep = first_occurrence(gather_rows(reference_indices, reference_sizes, group, device))
            references = gather_rows(references, reference_sizes, group, device, reference_keep)
            reference_labels = gather_rows(reference_labels, reference_sizes, group, device, reference_keep)
        else:
            references = gather_rows(queries, sizes, group, device, keep)
            reference_labels = gather_rows(query_labels, sizes, group, device, keep)
        if keep is not None:
            mine = keep[offset : offset + queries.shape[0]].to(queries.device)
            queries, query_labels, offset = queries[mine], query_labels[mine], int(keep[:offset].sum())
        sums = retrieval_sums(
            queries,
            query_labels,
            references,
            reference_labels,
            same_set=not has_references,
            query_offset=offset,
            metric=self.metric,
            chunk_size=self.chunk_size,
            max_memory=self.max_memory,
            backend=self.backend,
        )
        if self._distributed():
            sums = sums.to(device)
            dist.all_reduce(sums, group=group)
        return metrics_from_sums(sums.cpu())

    def _agree(self, device: torch.device | None) -> tuple[int, bool, bool, bool]:
        """Over all ranks: the embedding size, whether references exist, whether queries / references are indexed.

        Errors are decided on the agreed values, so every rank raises the same one and none waits.
        """
        sizes = {e.shape[1] for e in self.query_embeddings + self.reference_embeddings}
        local = [max(sizes, default=0), -min(sizes, default=_NO_SIZE)]  # the largest and (negated) smallest D
        stored = self.query_embeddings + self.reference_embeddings
        local.append(int(any(bool(e.isnan().any()) for e in stored)))  # one host read per compute
        for prefix in _SETS:
            updates, indexed = len(getattr(self, f"{prefix}_embeddings")), len(getattr(self, f"{prefix}_indices"))
            local += [int(updates > 0), int(indexed > 0), int(indexed < updates)]
        agreed = max_over_ranks(local, self.process_group, device)
        dimension, smallest, not_a_number = agreed[0], -agreed[1], agreed[2]
        queries, query_indexed, query_plain, references, reference_indexed, reference_plain = agreed[3:]
        if not_a_number:
            raise ValueError("KNNRetrieval got NaN embeddings (on some rank): their neighbours are undefined")
        if dimension and smallest != dimension:
            raise ValueError(
                f"KNNRetrieval got embeddings of sizes {smallest} and {dimension} (over all updates and ranks): "
                "every embedding must have the same size"
            )
        if not queries:
            raise ValueError("KNNRetrieval.compute() before any update: there are no query embeddings")
        for prefix, indexed, plain in (("query", query_indexed, query_plain), ("reference", reference_indexed,
                                                                               reference_plain)):  # fmt: skip
            if indexed and plain:
                raise ValueError(
                    f"`indices` were given with some {prefix} updates and not others: give them with every update "
                    "(on every rank) or with none"
                )
        return dimension, bool(references), bool(query_indexed), bool(reference_indexed)

    def _local(self, prefix: str, dimension: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's embeddings, labels and indices of one set; empty ``[0, D]`` ones if it has none."""
        embeddings = getattr(self, f"{prefix}_embeddings")
        if not embeddings:
            device = torch.device("cpu") if self.embeddings_on_cpu else self.device
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return torch.zeros(0, dimension, device=device), empty, empty
        labels, indices = dim_zero_cat(getattr(self, f"{prefix}_labels")), getattr(self, f"{prefix}_indices")
        return dim_zero_cat(embeddings), labels, dim_zero_cat(indices) if indices else labels.new_zeros(0)

    def _distributed(self) -> bool:
        return is_distributed(self.process_group)


_SETS = ("query", "reference")
_NO_SIZE = 2**62  # a rank without embeddings: no smallest size
