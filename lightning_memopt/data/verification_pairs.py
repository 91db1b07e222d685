"""Verification pairs over a labelled set: same-identity and different-identity pairs of its samples."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset


def verification_pairs(labels: Sequence[int]) -> list[tuple[int, int, bool]]:
    """Pairs ``(i, j, same)`` of sample indices, same-identity and different-identity alternating.

    Same: consecutive samples of each identity. Different: the first samples of consecutive
    identities, in a ring, at most one per identity and at most as many as same pairs. The two
    kinds alternate from the start, as in LFW's folds; with more than two samples per identity the
    same pairs outnumber the different ones, and the tail holds same pairs only.

    Example::

        >>> verification_pairs([0, 0, 1, 1, 2])
        [(0, 1, True), (0, 2, False), (2, 3, True), (2, 4, False)]
    """
    by_label: dict[int, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        by_label[int(label)].append(index)
    same = [(a, b, True) for members in by_label.values() for a, b in zip(members, members[1:], strict=False)]
    firsts = [members[0] for members in by_label.values()]
    neighbours = len(firsts) if len(firsts) > 2 else len(firsts) - 1  # a ring of three or more, else one pair
    different = [(firsts[i], firsts[(i + 1) % len(firsts)], False) for i in range(max(neighbours, 0))][: len(same)]
    pairs: list[tuple[int, int, bool]] = []
    for index in range(max(len(same), len(different))):
        pairs += [same[index]] if index < len(same) else []
        pairs += [different[index]] if index < len(different) else []
    return pairs


class PairDataset(Dataset):
    """``(image_a, image_b, same, pair_index)`` for each pair of :func:`verification_pairs` over ``dataset``.

    The index lets a metric restore the list order (and drop repeats) after a distributed sampler.
    """

    def __init__(self, dataset: Dataset, pairs: Sequence[tuple[int, int, bool]]) -> None:
        self.dataset, self.pairs = dataset, list(pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        first, second, same = self.pairs[index]
        return self.dataset[first][0], self.dataset[second][0], torch.tensor(same), torch.tensor(index)
