"""Synthetic, learnable face-recognition data generated on the fly (no files, no downloads)."""

from __future__ import annotations

import hashlib
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_memopt.arguments import check_bool, check_int
from lightning_memopt.data.face_datamodule import FaceDataModule
from lightning_memopt.data.pairs import PairDataset, verification_pairs
from lightning_memopt.data.resumable import disjoint_ranges

_PATTERN_SIZE = 8  # each identity is a random 3 x 8 x 8 pattern, upsampled to the image size
_MAX_SHIFT_FRACTION = 1 / 16  # translation of a sample, as a fraction of the image size
_BRIGHTNESS = 0.1  # additive brightness change in [-b, b] (images live in [-1, 1])
_CONTRAST = 0.1  # contrast factor in [1 - c, 1 + c]
_NOISE_STD = 0.1  # Gaussian pixel noise


def _generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from integers (a hash, so neighbouring keys give unrelated streams)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class SyntheticFaceDataset(Dataset):
    """``num_classes * samples_per_class`` synthetic faces; sample ``i`` of class ``c`` depends on
    ``(seed, c, first_sample + i)`` only and is generated when it is read.

    Every class has a prototype, a random 3×8×8 pattern in [-1, 1] upsampled bilinearly; a sample
    is a randomly translated crop of it with a small brightness and contrast change and Gaussian
    noise, clamped to [-1, 1]. Index ``k`` is sample ``k % samples_per_class`` of class
    ``k // samples_per_class``.

    Args:
        num_classes: number of identities.
        samples_per_class: samples of each identity in this dataset.
        image_size: height and width of the images.
        seed: seed of the whole dataset.
        first_sample: number of the first sample of each class, so that datasets with
            non-overlapping ranges (train and validation) hold different samples.

    Raises:
        ValueError: a count or size below 1, or a negative ``first_sample``.
        TypeError: an argument is not an integer.

    Example::

        >>> dataset = SyntheticFaceDataset(num_classes=3, samples_per_class=2, image_size=16, seed=0)
        >>> image, label = dataset[5]
        >>> image.shape, label, torch.equal(image, dataset[5][0])
        (torch.Size([3, 16, 16]), 2, True)
    """

    def __init__(
        self, num_classes: int, samples_per_class: int, image_size: int, seed: int, first_sample: int = 0
    ) -> None:
        self.num_classes = check_int("num_classes", num_classes, minimum=1)
        self.samples_per_class = check_int("samples_per_class", samples_per_class, minimum=1)
        self.image_size = image_size = check_int("image_size", image_size, minimum=1)
        self.seed = check_int("seed", seed)
        self.first_sample = check_int("first_sample", first_sample, minimum=0)
        self._shift = max(1, round(image_size * _MAX_SHIFT_FRACTION))
        # [image_size + 2 * shift, 8]: linear interpolation (align_corners=False) of 8 values.
        eye = torch.eye(_PATTERN_SIZE)[None]
        size = image_size + 2 * self._shift
        self._upsample = F.interpolate(eye, size=size, mode="linear", align_corners=False)[0].T.contiguous()

    def __len__(self) -> int:
        return self.num_classes * self.samples_per_class

    def _pattern(self, label: int) -> Tensor:
        """The random 3×8×8 pattern of class ``label``, in [-1, 1]."""
        return torch.rand(3, _PATTERN_SIZE, _PATTERN_SIZE, generator=_generator(self.seed, label)) * 2 - 1

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if not 0 <= operator.index(index) < len(self):
            raise IndexError(f"index {index!r} out of range for a dataset of {len(self)} samples")
        label, sample = divmod(operator.index(index), self.samples_per_class)
        rng = _generator(self.seed, label, self.first_sample + sample)
        dy, dx = torch.randint(0, 2 * self._shift + 1, (2,), generator=rng).tolist()
        brightness, contrast = (torch.rand(2, generator=rng) * 2 - 1).tolist()
        pattern = self._pattern(label) * (1 + _CONTRAST * contrast) + _BRIGHTNESS * brightness
        # Bilinear upsampling is separable: the rows and the columns of the shifted crop are
        # windows of the 1-D interpolation matrix, so the crop is two small matmuls. (Its weights
        # sum to 1, so the brightness/contrast change can be applied to the 8×8 pattern.)
        rows = self._upsample[dy : dy + self.image_size]
        cols = self._upsample[dx : dx + self.image_size]
        image = torch.normal(rows @ pattern @ cols.T, _NOISE_STD, generator=rng)
        return image.clamp_(-1.0, 1.0), label


class SyntheticFaceDataModule(FaceDataModule):
    """Face-recognition data made of deterministic synthetic identities, for tests and benchmarks.

    Samples are generated on the fly in ``__getitem__`` (see ``SyntheticFaceDataset``), so any
    size costs no memory; train and validation samples of a class are different draws.

    Args:
        num_classes: number of identities, at least 1.
        samples_per_class: training samples per identity, at least 1.
        val_samples_per_class: validation samples per identity, at least 0 (0: no validation).
        image_size: height and width, at least 16 and divisible by 16 (IResNet downsamples 16×).
        seed: seed of the data; the same seed gives the same images.
        verification_pairs: also give a second validation loader of ``(image_a, image_b, same)``
            pairs over the validation samples (:func:`~lightning_memopt.data.verification_pairs`),
            for face-verification metrics; needs at least 2 validation samples per identity.
        **kwargs: loader arguments of ``FaceDataModule`` (``batch_size``, ``augmentation`` …).

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> dm = SyntheticFaceDataModule(num_classes=4, samples_per_class=2, image_size=16, batch_size=4)
        >>> dm.setup()
        >>> images, labels = next(iter(dm.train_dataloader()))
        >>> images.shape, bool(images.min() >= -1 and images.max() <= 1), len(dm.val_dataset)
        (torch.Size([4, 3, 16, 16]), True, 8)
    """

    def __init__(
        self,
        num_classes: int = 100,
        samples_per_class: int = 16,
        val_samples_per_class: int = 2,
        image_size: int = 112,
        seed: int = 0,
        verification_pairs: bool = False,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        num_classes = check_int("num_classes", num_classes, minimum=1)
        samples_per_class = check_int("samples_per_class", samples_per_class, minimum=1)
        val_samples_per_class = check_int("val_samples_per_class", val_samples_per_class, minimum=0)
        image_size = check_int("image_size", image_size, minimum=16)
        if image_size % 16:
            raise ValueError(f"`image_size` must be a multiple of 16 and at least 16 (e.g. 112), got {image_size!r}")
        seed = check_int("seed", seed)
        verification_pairs = check_bool("verification_pairs", verification_pairs)
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.samples_per_class = samples_per_class
        self.val_samples_per_class = val_samples_per_class
        self.image_size = image_size
        self.seed = seed
        self.verification_pairs = verification_pairs

    def _samples(self, per_class: int, first_sample: int) -> SyntheticFaceDataset:
        return SyntheticFaceDataset(self.num_classes, per_class, self.image_size, self.seed, first_sample)

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return disjoint_ranges(self._samples, self.samples_per_class, self.val_samples_per_class)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches; with ``verification_pairs``, ``[samples, pairs]`` (pairs when there are any)."""
        samples = super().val_dataloader()
        if not self.verification_pairs or not samples:
            return samples
        labels = [index // self.val_samples_per_class for index in range(len(self.val_dataset))]  # type: ignore[arg-type]
        pairs = verification_pairs(labels)
        if not pairs:
            return samples
        pair_set = PairDataset(self.val_dataset, pairs)  # type: ignore[arg-type]
        return [samples, self.evaluation_loader(pair_set)]
