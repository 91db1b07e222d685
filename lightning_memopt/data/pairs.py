"""Verification pairs over a labelled set: same-identity and different-identity pairs of its samples."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import check_bool, check_int


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

    Args:
        dataset: a dataset of ``(image, label)`` samples.
        pairs: ``(index_a, index_b, same)`` triples of sample positions in ``dataset``, as
            :func:`verification_pairs` makes them.

    Raises:
        TypeError: a pair is not ``(int, int, bool)``.
        ValueError: a pair names a sample outside ``dataset``.

    Example::

        >>> pairs = PairDataset([(torch.zeros(1), 0), (torch.ones(1), 0)], [(0, 1, True)])
        >>> [item.tolist() for item in pairs[0]]
        [[0.0], [1.0], True, 0]
        >>> PairDataset([(torch.zeros(1), 0)], [(0, 1, True)])
        Traceback (most recent call last):
        ...
        ValueError: `pairs[0]` = (0, 1, True) names sample 1, outside a dataset of 1 samples
    """

    def __init__(self, dataset: Dataset, pairs: Sequence[tuple[int, int, bool]]) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        self.dataset, self.pairs = dataset, []
        for position, pair in enumerate(pairs):
            name = f"pairs[{position}]"
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 3:
                raise TypeError(f"`{name}` must be (index, index, same), got {pair!r}")
            first, second = (check_int(name, index) for index in pair[:2])
            for index in (first, second):
                if not 0 <= index < size:
                    raise ValueError(
                        f"`{name}` = {tuple(pair)!r} names sample {index}, outside a dataset of {size} samples"
                    )
            self.pairs.append((first, second, check_bool(name, pair[2])))

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        first, second, same = self.pairs[index]
        return self.dataset[first][0], self.dataset[second][0], torch.tensor(same), torch.tensor(index)
