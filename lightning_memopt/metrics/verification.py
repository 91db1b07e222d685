"""FaceVerification: accuracy by 10-fold threshold selection (the LFW protocol) and TAR at FAR, from pair scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_memopt.arguments import check_int
from lightning_memopt.metrics.functional.verification import check_far, tar_at_far, verification_accuracy


class FaceVerification(Metric):
    """Verification accuracy and TAR at FAR of embedding pairs, storing one score per pair.

    ``update(first, second, same)`` takes ``[B, D]`` embeddings of the two sides of ``B`` pairs and
    whether each pair is the same identity. Alternatively it takes ``first_labels`` and
    ``second_labels``, with ``same = first_labels == second_labels``. Only the pairs' cosine
    similarities are kept, 8 bytes per pair with its flag, so memory is bounded by the number of
    pairs, never by ``D``. Under DDP the scores are gathered at compute.

    ``compute()`` returns:
    - ``accuracy``: the mean over ``folds`` contiguous folds, each tested at the threshold that is
      best on the other folds.
    - ``threshold``: the mean of those thresholds.
    - ``tar_at_far_…``: one entry for each of ``far_targets`` (``tar_at_far_0.001``).

    Args:
        folds: contiguous folds of the pair list for the accuracy's threshold selection, at least 2.
        far_targets: false-accept rates in (0, 1] at which the true-accept rate is reported.
        **kwargs: torchmetrics ``Metric`` options (``compute_on_cpu``, ``process_group``, …).

    Raises:
        ValueError: for ``folds`` < 2, FARs outside (0, 1], mismatched shapes, or compute without pairs.
        TypeError: ``folds`` or a FAR that is no number, ``far_targets`` that is no list.

    Example::

        >>> metric = FaceVerification(folds=2, far_targets=(0.5,))
        >>> a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
        >>> b = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.1, 0.9], [0.9, 0.1]])
        >>> metric.update(a, b, torch.tensor([True, False, True, False]))
        >>> metric.compute()["accuracy"]
        1.0
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    scores: list[torch.Tensor]
    same: list[torch.Tensor]
    indices: list[torch.Tensor]

    def __init__(self, folds: int = 10, far_targets: Sequence[float] = (1e-4, 1e-3), **kwargs: Any) -> None:
        folds = check_int("folds", folds, minimum=2)
        if isinstance(far_targets, str) or not isinstance(far_targets, Sequence):
            raise TypeError(
                f"`far_targets` must be a list of FARs in (0, 1], e.g. [1e-4, 1e-3], got {far_targets!r} "
                f"({type(far_targets).__name__})"
            )
        far_targets = tuple(check_far(far, "far_targets") for far in far_targets)
        super().__init__(**kwargs)
        self.folds, self.far_targets = folds, far_targets
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("same", default=[], dist_reduce_fx="cat")
        self.add_state("indices", default=[], dist_reduce_fx="cat")

    def update(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        same: torch.Tensor | None = None,
        first_labels: torch.Tensor | None = None,
        second_labels: torch.Tensor | None = None,
        pair_indices: torch.Tensor | None = None,
    ) -> None:
        """Add the pairs ``(first[i], second[i])``; ``same`` or both label tensors say which match.

        ``pair_indices`` (the pairs' positions in the pair list) put the pairs back in list order at
        compute and count each once. Under DDP a sampler deals the pairs out to ranks (and may pad
        with repeats), and the folds are only the single-device ones in list order.
        """
        if first.dim() != 2 or first.shape != second.shape:
            raise ValueError(f"`first` {list(first.shape)} and `second` {list(second.shape)} must both be [B, D]")
        if same is None:
            if first_labels is None or second_labels is None:
                raise ValueError("give `same`, or both `first_labels` and `second_labels`")
            same = first_labels == second_labels
        if same.shape != (first.shape[0],):
            raise ValueError(f"`same` {list(same.shape)} must hold one flag per pair ({first.shape[0]})")
        scores = F.cosine_similarity(first.detach().float(), second.detach().float(), dim=1)
        self.scores.append(scores)
        self.same.append(same.detach().bool())
        if pair_indices is not None:
            if pair_indices.shape != (first.shape[0],):
                raise ValueError(
                    f"`pair_indices` {list(pair_indices.shape)} must hold one index per pair ({first.shape[0]})"
                )
            self.indices.append(pair_indices.detach().long())

    def _sync_dist(self, dist_sync_fn: Callable = gather_all_tensors, process_group: Any | None = None) -> None:
        """A rank without pairs sends empty states of their own dtypes (torchmetrics would send fp32 for all)."""
        for name, dtype in (("scores", torch.float32), ("same", torch.bool), ("indices", torch.long)):
            state = getattr(self, name)
            if isinstance(state, list) and not state:
                state.append(torch.zeros(0, dtype=dtype, device=self.device))
        super()._sync_dist(dist_sync_fn, process_group)

    def compute(self) -> dict[str, float]:
        scores = dim_zero_cat(self.scores).cpu() if not isinstance(self.scores, list) or self.scores else None
        if scores is None or scores.numel() == 0:  # (after a DDP sync the states are gathered tensors)
            raise ValueError("FaceVerification.compute() before any update: there are no pairs")
        same = dim_zero_cat(self.same).cpu()
        indices = dim_zero_cat(self.indices) if not isinstance(self.indices, list) or self.indices else None
        if indices is not None and indices.numel():  # (none given: an empty list, or an empty tensor after a sync)
            scores, same = _in_list_order(indices.cpu(), scores, same)
        accuracy, threshold = verification_accuracy(scores, same, self.folds)
        result = {"accuracy": accuracy, "threshold": threshold}
        for far in self.far_targets:
            result[f"tar_at_far_{far:g}"] = tar_at_far(scores, same, far)
        return result


def _in_list_order(
    indices: torch.Tensor, scores: torch.Tensor, same: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by their index in the pair list, each index once (a padding sampler repeats some)."""
    if indices.numel() != scores.numel():
        raise ValueError(
            f"`pair_indices` came with {indices.numel()} of the {scores.numel()} pairs: "
            "give them in every update or in none"
        )
    order = torch.argsort(indices, stable=True)
    indices, scores, same = indices[order], scores[order], same[order]
    first = torch.ones_like(indices, dtype=torch.bool)
    first[1:] = indices[1:] != indices[:-1]
    return scores[first], same[first]
