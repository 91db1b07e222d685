"""`FaceDataModule`: the loaders, augmentation and batch format shared by every face datamodule.

Batches are ``(images, labels)``: ``images`` float32 [B, 3, H, W] normalised to [-1, 1] as in
insightface (``(x / 255 - 0.5) / 0.5``), ``labels`` int64 [B] in ``[0, num_classes)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from omegaconf import Container, OmegaConf
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import InputError
from lightning_memopt.data.augment import FaceAugmentation
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.resumable import EpochIndex, run_seed, sample_generator

_AUGMENTATION_KEYS = tuple(inspect.signature(FaceAugmentation).parameters)


def to_face_tensor(image: np.ndarray) -> Tensor:
    """Convert one HWC uint8 RGB image to a CHW float32 tensor in [-1, 1].

    Args:
        image: array of shape [H, W, 3] and dtype uint8 (a read-only memmap slice is fine).

    Example::

        >>> to_face_tensor(np.array([[[0, 255, 51]]], dtype=np.uint8)).flatten().tolist()
        [-1.0, 1.0, -0.6000000238418579]
    """
    tensor = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return (tensor.float() / 255.0 - 0.5) / 0.5


def split_per_identity(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices into train and validation, separately within every identity.

    Each identity with ``n`` samples gives ``round(n * val_fraction)`` of them, chosen at random
    from ``seed``, to validation, but always keeps at least one for training. Both index arrays
    come back sorted, so samples keep their on-disk order.

    Args:
        labels: int array [N], the identity of every sample.
        val_fraction: fraction in [0, 1) of each identity's samples that go to validation.
        seed: seed of the random choice; the same labels and seed give the same split.

    Raises:
        ValueError: ``val_fraction`` is outside [0, 1).

    Example::

        >>> train, val = split_per_identity(np.array([0, 0, 0, 0, 1, 1]), val_fraction=0.5, seed=0)
        >>> len(train), len(val)
        (3, 3)
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction!r}")
    labels = np.asarray(labels, dtype=np.int64)
    if val_fraction == 0.0 or labels.size == 0:
        return np.arange(labels.size), np.empty(0, dtype=np.int64)
    # Group samples by identity with a random order inside each group, then send the first
    # `n_val` of every group to validation.
    order = np.lexsort((np.random.default_rng(seed).random(labels.size), labels))
    sorted_labels = labels[order]
    _, group_start, counts = np.unique(sorted_labels, return_index=True, return_counts=True)
    n_val = np.minimum(np.rint(counts * val_fraction), counts - 1).astype(np.int64)
    group = np.repeat(np.arange(counts.size), counts)
    rank = np.arange(labels.size) - group_start[group]
    is_val = np.zeros(labels.size, dtype=bool)
    is_val[order] = rank < n_val[group]
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def per_identity_datasets(
    labels: np.ndarray, val_fraction: float, seed: int, make: Callable[[np.ndarray], Dataset]
) -> tuple[Dataset, Dataset | None]:
    """``(train, val)``: ``make(indices)`` of each part of :func:`split_per_identity`; ``val`` is None when empty.

    Example::

        >>> per_identity_datasets(np.array([0, 0, 1]), 0.0, seed=0, make=lambda indices: indices.tolist())
        ([0, 1, 2], None)
    """
    train_index, val_index = split_per_identity(labels, val_fraction, seed)
    train = make(train_index)
    return train, make(val_index) if val_index.size else None


def check_class_count(num_classes: int | None, found: int, source: str) -> int:
    """``found``, the identities the data holds, if ``num_classes`` (the count expected, or None) agrees.

    Raises:
        InputError: ``num_classes`` differs; the message quotes ``source``, where the count was found.

    Example::

        >>> check_class_count(None, 3, "'faces' has 3 identity folders")
        3
    """
    if num_classes is not None and num_classes != found:
        raise InputError(f"`num_classes`={num_classes!r} but {source}; set `num_classes` to that count or to None")
    return found


def _as_augmentation(value: FaceAugmentation | Mapping[str, Any] | None) -> FaceAugmentation | None:
    """Accept an augmentation, a mapping of its arguments (as Hydra passes it) or None."""
    if value is None or isinstance(value, FaceAugmentation):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(str(key) for key in value if key not in _AUGMENTATION_KEYS)
        if unknown:
            raise ValueError(
                f"`augmentation` got unknown keys {unknown!r}; valid keys are {list(_AUGMENTATION_KEYS)!r}"
            )
        return FaceAugmentation(**{str(key): item for key, item in value.items()})
    raise TypeError(f"`augmentation` must be a FaceAugmentation, a dict of its arguments or None, got {value!r}")


class _AugmentedDataset(Dataset):
    """Apply an augmentation to the image of every ``(image, label)`` sample of a dataset.

    Keyed by :class:`~lightning_memopt.data.resumable.EpochIndex`, a sample's randomness comes from
    ``(seed, epoch, index)`` alone (a resumed run augments as the uninterrupted one); keyed by a plain
    index, from torch's global RNG.
    """

    takes_epoch_keys = True

    def __init__(self, dataset: Dataset, augmentation: FaceAugmentation) -> None:
        self.dataset = dataset
        self.augmentation = augmentation
        self.seed = run_seed()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | EpochIndex) -> tuple[Tensor, int]:
        if isinstance(key, EpochIndex):
            image, label = self.dataset[key.index]
            return self.augmentation(image, generator=sample_generator(self.seed, key.epoch, key.index)), label
        image, label = self.dataset[key]
        return self.augmentation(image), label


class FaceDataModule(LoaderDataModule):
    """Base of the face-recognition datamodules: loaders, augmentation and hyperparameters.

    A subclass sets ``num_classes`` in its ``__init__`` (after calling this one) and implements
    ``_build_datasets()``, returning ``(train, val)`` datasets of ``(CHW image in [-1, 1], label)``
    samples (``val`` may be None). Datasets are built once, on the first ``setup()``. The
    constructor arguments of the subclass are saved as hyperparameters, the augmentation in its
    dict form, so a checkpoint can rebuild the datamodule.

    Args:
        batch_size: training batch size, at least 1.
        val_batch_size: validation batch size; ``None`` means ``batch_size``.
        num_workers: DataLoader worker processes, at least 0.
        pin_memory: pin batches in page-locked memory (faster host-to-GPU copies).
        persistent_workers: keep workers alive between epochs; needs ``num_workers > 0``.
        augmentation: training augmentation, as a ``FaceAugmentation``, a dict of its arguments,
            or ``None`` for none. Validation data is never augmented.
        drop_last: drop the last incomplete training batch.

    Raises:
        ValueError: an argument is out of range, or ``augmentation`` has unknown keys.
        TypeError: ``augmentation`` has an unsupported type.

    Example::

        >>> from lightning_memopt.data import SyntheticFaceDataModule
        >>> dm = SyntheticFaceDataModule(num_classes=2, samples_per_class=4, image_size=16, batch_size=4)
        >>> images, labels = next(iter(dm.train_dataloader()))
        >>> images.shape, labels.dtype
        (torch.Size([4, 3, 16, 16]), torch.int64)
    """

    num_classes: int

    def __init__(
        self,
        batch_size: int = 128,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        augmentation: FaceAugmentation | Mapping[str, Any] | None = None,
        drop_last: bool = True,
    ) -> None:
        super().__init__(batch_size, val_batch_size, num_workers, pin_memory, persistent_workers, drop_last)
        self.augmentation = _as_augmentation(augmentation)
        self._save_init_hyperparameters(inspect.currentframe())

    def _save_init_hyperparameters(self, frame: Any) -> None:
        # Lightning collects the arguments of every `__init__` up the subclass chain from this
        # frame. Hydra containers become plain lists/dicts and the augmentation its dict, so
        # hparams.yaml and checkpoints hold no custom objects.
        self.save_hyperparameters(ignore=["augmentation"], frame=frame)
        hparams = {
            key: OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value
            for key, value in self.hparams.items()
        }
        hparams["augmentation"] = None if self.augmentation is None else self.augmentation.to_dict()
        self.save_hyperparameters(hparams, frame=frame)

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets on the first call (the training set augmented); later calls do nothing."""
        if self._datasets is not None:
            return
        train, val = self._build_datasets()
        if self.augmentation is not None and not self.augmentation.is_identity:
            train = _AugmentedDataset(train, self.augmentation)
        self._datasets = (train, val)
