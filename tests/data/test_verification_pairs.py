import pytest
import torch

from lightning_memopt.data import PairDataset, SyntheticFaceDataModule, verification_pairs


def test_pairs_are_balanced_interleaved_and_labelled_right():
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 3]
    pairs = verification_pairs(labels)
    same = [pair for pair in pairs if pair[2]]
    different = [pair for pair in pairs if not pair[2]]
    assert len(same) == 5 and len(different) == 4  # 4 identities with a first sample: a ring of 4
    assert all(labels[a] == labels[b] for a, b, _ in same) and all(labels[a] != labels[b] for a, b, _ in different)
    assert [flag for _, _, flag in pairs[:4]] == [True, False, True, False]
    assert len(set(pairs)) == len(pairs)


def test_no_same_identity_pairs_without_a_second_sample():
    assert verification_pairs([0, 1, 2]) == []
    assert verification_pairs([0, 0, 1, 1]) == [(0, 1, True), (0, 2, False), (2, 3, True)]


def test_the_synthetic_datamodule_gives_a_pair_loader():
    data = SyntheticFaceDataModule(num_classes=3, samples_per_class=1, val_samples_per_class=2, image_size=16,
                                   batch_size=2, verification_pairs=True)  # fmt: skip
    samples, pairs = data.val_dataloader()
    first, second, same, index = next(iter(pairs))
    assert first.shape == (2, 3, 16, 16) and same.dtype == torch.bool and index.tolist() == [0, 1]
    dataset = pairs.dataset
    assert isinstance(dataset, PairDataset) and len(dataset) == 6
    a, b, flag, _ = dataset[0]
    assert torch.equal(a, data.val_dataset[0][0]) and torch.equal(b, data.val_dataset[1][0]) and bool(flag)
    single = SyntheticFaceDataModule(num_classes=3, samples_per_class=1, val_samples_per_class=1, image_size=16,
                                     batch_size=2, verification_pairs=True)  # fmt: skip
    assert not isinstance(single.val_dataloader(), list)  # no identity has two samples: no pairs


@pytest.mark.parametrize(
    ("pairs", "error", "message"),
    [
        ([(0, 3, True)], ValueError, r"`pairs\[0\]` = \(0, 3, True\) names sample 3, outside a dataset of 3 samples"),
        ([(0, 1, True), (-1, 1, False)], ValueError, r"`pairs\[1\]` = \(-1, 1, False\) names sample -1"),
        ([(0, 1)], TypeError, r"`pairs\[0\]` must be \(index, index, same\), got \(0, 1\)"),
        (["012"], TypeError, r"`pairs\[0\]` must be \(index, index, same\), got '012'"),
        ([(0, "1", True)], TypeError, r"`pairs\[0\]` must be an integer, got '1' \(str\)"),
        ([(0, 1, "perhaps")], ValueError, r"`pairs\[0\]` must be true or false, got 'perhaps'"),
    ],
)
def test_bad_pairs_are_refused(pairs, error, message):
    dataset = [(torch.zeros(1), label) for label in (0, 0, 1)]
    with pytest.raises(error, match=message):
        PairDataset(dataset, pairs)
