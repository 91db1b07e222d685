"""Face images on disk, one sub-folder per identity: scanning, decoding and the datamodule."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import InputError, check_optional_int
from lightning_memopt.data.checks import check_directory, check_extensions, check_split
from lightning_memopt.data.face_datamodule import (
    FaceDataModule,
    check_class_count,
    per_identity_datasets,
    to_face_tensor,
)

DEFAULT_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
# What PIL raises for missing, truncated or corrupt files (UnidentifiedImageError is an OSError).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def scan_image_folder(
    root: str | os.PathLike[str], extensions: Sequence[str] = DEFAULT_EXTENSIONS
) -> tuple[list[str], list[tuple[str, int]]]:
    """List the identities and image files of a folder with one sub-folder per identity.

    Identities are the sorted sub-folder names (labels 0..C-1); files are sorted by name within
    each. Names starting with ``.`` are skipped; extensions match case-insensitively.

    Args:
        root: the folder holding one sub-folder per identity.
        extensions: file name endings counted as images.

    Returns:
        ``(class_names, samples)`` with ``samples`` a list of ``(path, label)``.

    Raises:
        FileNotFoundError: ``root`` does not exist or is not a folder.
        ValueError: ``root`` has no identity folders, or an identity folder has no images.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     for name in ("bob", "alice"):
        ...         os.makedirs(os.path.join(root, name))
        ...         Image.new("RGB", (4, 4)).save(os.path.join(root, name, "0.png"))
        ...     classes, samples = scan_image_folder(root)
        >>> classes, [label for _, label in samples]
        (['alice', 'bob'], [0, 1])
    """
    root = check_directory("root", root, "image folder")
    suffixes = tuple(extension.lower() for extension in check_extensions("extensions", extensions))
    with os.scandir(root) as entries:
        classes = sorted(entry.name for entry in entries if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise InputError(f"image folder `root` {root!r} has no identity sub-folders (one per identity)")
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        files = list_image_files(folder, suffixes)
        if not files:
            raise InputError(f"identity folder {folder!r} has no image files (extensions {list(suffixes)!r})")
        samples.extend((os.path.join(folder, file), label) for file in files)
    return classes, samples


def list_image_files(folder: str, suffixes: tuple[str, ...]) -> list[str]:
    """Sorted names of the visible files in ``folder`` whose lower-cased name ends with one of ``suffixes``."""
    with os.scandir(folder) as entries:
        return sorted(
            entry.name
            for entry in entries
            if entry.is_file() and not entry.name.startswith(".") and entry.name.lower().endswith(suffixes)
        )


def image_size_of(path: str) -> tuple[int, int]:
    """The ``(width, height)`` of an image file, reading only its header.

    Raises:
        RuntimeError: the file cannot be opened as an image.
    """
    try:
        with Image.open(path) as image:
            return image.size
    except _DECODE_ERRORS as error:
        raise RuntimeError(f"cannot read image {path!r}: {error}") from error


def load_face_image(path: str, size: tuple[int, int] | None, reference: str | None = None) -> np.ndarray:
    """Decode an image file to an HWC uint8 RGB array of a required size.

    Args:
        path: the image file.
        size: the required ``(width, height)``, or None for whatever size the file has.
        reference: when given, the size is a requirement taken from this file and a mismatch is
            an error; when None, an image of another size is resized to ``size`` (PIL bilinear).

    Raises:
        RuntimeError: the file cannot be decoded.
        ValueError: ``reference`` is given and the image size differs from ``size``.
    """
    try:
        with Image.open(path) as image:
            file_size = image.size
            if reference is None or size is None or file_size == size:
                rgb = image.convert("RGB")
                if size is not None and rgb.size != size:
                    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
                return np.asarray(rgb, dtype=np.uint8)
    except _DECODE_ERRORS as error:
        raise RuntimeError(f"cannot read image {path!r}: {error}") from error
    assert size is not None
    raise InputError(
        f"image {path!r} is {file_size[0]}x{file_size[1]} but {reference!r} is {size[0]}x{size[1]};"
        " all images must share one size, or set `image_size` to resize them"
    )


class ImageFolderFaceDataset(Dataset):
    """Face images read from files; a sample is ``(CHW float image in [-1, 1], label)``.

    Args:
        samples: ``(path, label)`` pairs.
        image_size: resize every image to ``image_size`` × ``image_size``; None keeps the file
            size, which must then equal that of ``reference``.
        reference: the file whose size all images share when ``image_size`` is None (by
            default the first sample).

    Raises:
        TypeError: ``image_size`` is not an integer.
        ValueError: ``image_size`` is below 1; when a sample is read, ``image_size`` is None and the
            image has another size than ``reference``.
        RuntimeError: an image cannot be decoded (when it is read), naming the file.
    """

    def __init__(
        self, samples: Sequence[tuple[str, int]], image_size: int | None = None, reference: str | None = None
    ) -> None:
        self.samples = list(samples)
        self.image_size = image_size = check_optional_int("image_size", image_size, minimum=1)
        self.reference = reference or (self.samples[0][0] if self.samples else None)
        self._size: tuple[int, int] | None = None if image_size is None else (image_size, image_size)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        """Sample ``index`` as an HWC uint8 array and its label."""
        path, label = self.samples[index]
        if self.image_size is not None:
            return load_face_image(path, self._size), label
        if self._size is None:
            assert self.reference is not None
            self._size = image_size_of(self.reference)
        return load_face_image(path, self._size, reference=self.reference), label

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image, label = self.load(index)
        return to_face_tensor(image), label


class ImageFolderFaceDataModule(FaceDataModule):
    """Face-recognition data from a folder with one sub-folder of images per identity.

    Identities are the sorted sub-folder names (labels 0..C-1). The folder is scanned in
    ``__init__``, so ``num_classes`` is known right away; images are decoded (PIL, RGB) when read.

    Args:
        root: the folder holding one sub-folder per identity.
        num_classes: expected number of identities (checked), or None to take the count found.
        image_size: resize images (PIL bilinear) to this square size; None keeps file sizes,
            which must then all equal that of the first image.
        val_fraction: fraction in [0, 1) of each identity's images held out for validation,
            chosen at random from ``seed``.
        seed: seed of the train/validation split.
        extensions: file name endings counted as images (case-insensitive).
        **kwargs: loader arguments of ``FaceDataModule`` (``batch_size``, ``augmentation`` …).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: no identity folders, an identity folder without images, ``num_classes``
            differs from the count found, or an argument is out of range.
        TypeError: an argument has the wrong kind (``extensions=".png"``: give a list).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     for name in ("alice", "bob"):
        ...         os.makedirs(os.path.join(root, name))
        ...         for i in range(2):
        ...             Image.new("RGB", (20, 20)).save(os.path.join(root, name, f"{i}.png"))
        ...     dm = ImageFolderFaceDataModule(root, image_size=16, batch_size=4)
        ...     images, labels = next(iter(dm.train_dataloader()))
        >>> dm.num_classes, images.shape, sorted(labels.tolist())
        (2, torch.Size([4, 3, 16, 16]), [0, 0, 1, 1])
    """

    def __init__(
        self,
        root: str,
        num_classes: int | None = None,
        image_size: int | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
        extensions: Sequence[str] = DEFAULT_EXTENSIONS,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        root = check_directory("root", root, "image folder")
        num_classes = check_optional_int("num_classes", num_classes, minimum=1)
        image_size = check_optional_int("image_size", image_size, minimum=1)
        val_fraction, seed = check_split(val_fraction, seed)
        check_extensions("extensions", extensions)
        super().__init__(**kwargs)
        self.root = root
        self.classes, self.samples = scan_image_folder(self.root, extensions)
        found = f"{self.root!r} has {len(self.classes)} identity folders"
        self.num_classes = check_class_count(num_classes, len(self.classes), found)
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.seed = seed

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        labels = np.fromiter((label for _, label in self.samples), dtype=np.int64, count=len(self.samples))
        reference = self.samples[0][0]

        def images(indices: np.ndarray) -> ImageFolderFaceDataset:
            return ImageFolderFaceDataset([self.samples[i] for i in indices], self.image_size, reference)

        return per_identity_datasets(labels, self.val_fraction, self.seed, images)
