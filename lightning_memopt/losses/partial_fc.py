"""Partial FC: the margin softmax over a sampled subset of class centres."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memopt.losses.margin import CombinedMarginLoss, Reduction
from lightning_memopt.models.structure import MemoryStructure
from lightning_memopt.private_api import is_fake


class PartialFC(nn.Module):
    """Class-centre classifier whose softmax runs over all positive centres plus sampled negatives.

    Each training step keeps every class present in the batch and fills up to
    ``⌊sample_rate · num_classes⌋`` centres with classes drawn uniformly without replacement, so
    the logits shrink from ``B × num_classes`` to ``B × sampled``. With ``sample_rate=1`` (or in
    eval mode) nothing is sampled and the loss is exactly the full margin softmax.

    The centres are not sharded: under DDP every rank holds the whole ``num_classes × d`` weight,
    its gradient and optimizer state, and samples its own subset. This saves the logits' memory;
    the published per-GPU saving of Partial FC also splits the centres across GPUs, which this
    class does not do.

    Args:
        num_classes: number of identities.
        embedding_size: size of the embeddings fed in.
        sample_rate: fraction of class centres per step, in (0, 1].
        margin_loss: the margin softmax applied to the cosine logits (ArcFace by default).

    Raises:
        ValueError: for ``sample_rate`` outside (0, 1] or ``num_classes`` / ``embedding_size`` < 1.

    Example::

        >>> head = PartialFC(num_classes=1000, embedding_size=8, sample_rate=0.1)
        >>> loss, logits, target = head(torch.randn(4, 8), torch.tensor([1, 2, 2, 999]))
        >>> logits.shape, bool((logits.argmax(1) >= 0).all())
        (torch.Size([4, 100]), True)
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int = 512,
        sample_rate: float = 1.0,
        margin_loss: CombinedMarginLoss | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"`sample_rate`={sample_rate!r} must be in (0, 1] (1.0 = full softmax, 0.1 = Partial FC)")
        if num_classes < 1 or embedding_size < 1:
            raise ValueError(f"`num_classes`={num_classes!r} and `embedding_size`={embedding_size!r} must both be >= 1")
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.num_sample = max(1, int(sample_rate * num_classes + 1e-9))  # ⌊rate · classes⌋, robust to 0.3 * 10
        self.margin_loss = margin_loss if margin_loss is not None else CombinedMarginLoss()
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.normal_(self.weight, 0.0, 0.01)

    def sample_classes(self, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Pick the class centres for one step.

        Returns:
            ``(class_index, target)``: the sampled class ids, sorted, and each sample's label
            re-indexed into them.

        Raises:
            ValueError: for labels outside ``[0, num_classes)``.
        """
        if not is_fake(labels):  # fake tensors (memory planning) have no values to check
            low, high = int(labels.min()), int(labels.max())  # syncs with the host, as any sampling must
            if low < 0 or high >= self.num_classes:
                raise ValueError(
                    f"labels must lie in [0, {self.num_classes}) for `num_classes`={self.num_classes}; "
                    f"got values in [{low}, {high}]"
                )
        count = self.num_sample
        if is_fake(labels):
            # The positives' count depends on the values, which a fake tensor lacks (and `unique` has no fake
            # shape): plan for the most classes a step can use, one per sample beyond the sample size.
            count = min(self.num_classes, max(self.num_sample, labels.numel()))
        elif labels.numel() >= self.num_sample:  # enough samples for the positives alone to fill the sample
            positives = torch.unique(labels, sorted=True)
            if positives.numel() >= self.num_sample:
                return positives, torch.searchsorted(positives, labels)
        # every positive scores 2, every other class a uniform draw below 1: top-k keeps them all
        score = torch.rand(self.num_classes, device=labels.device)
        score[labels] = 2.0
        class_index = score.topk(count, sorted=False).indices.sort().values
        return class_index, torch.searchsorted(class_index, labels)

    def memory_structure(self) -> MemoryStructure:
        """The margin head is an fp32 island: its logits span every class."""
        return MemoryStructure(fp32_islands=(self,))

    def forward(
        self, embeddings: Tensor, labels: Tensor, reduction: Reduction = "mean"
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Loss over the (sampled) centres, in fp32 with autocast off.

        Returns:
            ``(loss, cosine, target)``: the loss (scalar; ``[B]`` per sample with ``reduction="none"``),
            the cosine logits it was computed from (``B × classes used``) and each label's column in
            them, for accuracy.
        """
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            if self.training and self.num_sample < self.num_classes:
                class_index, target = self.sample_classes(labels)
                weight = self.weight[class_index]
            else:
                weight, target = self.weight, labels
            cosine = F.linear(F.normalize(embeddings.float()), F.normalize(weight.float()))
            return self.margin_loss(cosine, target, reduction), cosine, target

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, sample_rate={self.sample_rate}, num_sample={self.num_sample}"
