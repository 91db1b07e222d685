"""The memmap face format (raw uint8 pixels + labels + meta), its validation and its datamodule.

A dataset is a directory of three files:

- ``images.u8``: raw uint8 pixels, N×H×W×3, row-major (read with ``numpy.memmap``);
- ``labels.npy``: int64 [N], identities in ``[0, num_classes)``;
- ``meta.json``: ``{"format": "lightning_memopt.faces.v1", "count": N, "height": H, "width": W,
  "channels": 3, "num_classes": C}``.

:func:`pack_image_folder` (the command line: ``memopt-pack-faces``) writes it from an image folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import InputError, check_file, check_int, check_optional_int
from lightning_memopt.data.checks import check_directory, check_split
from lightning_memopt.data.face_datamodule import (
    FaceDataModule,
    check_class_count,
    per_identity_datasets,
    to_face_tensor,
)
from lightning_memopt.data.image_folder_face import ImageFolderFaceDataset, scan_image_folder

FORMAT = "lightning_memopt.faces.v1"
IMAGES_FILE = "images.u8"
LABELS_FILE = "labels.npy"
META_FILE = "meta.json"
_META_INTS = ("count", "height", "width", "channels", "num_classes")


def make_meta(count: int, height: int, width: int, num_classes: int) -> dict[str, Any]:
    """The ``meta.json`` content of a dataset of ``count`` RGB images of ``height`` × ``width``.

    Example::

        >>> make_meta(count=10, height=112, width=112, num_classes=2)["format"]
        'lightning_memopt.faces.v1'
    """
    return {
        "format": FORMAT,
        "count": count,
        "height": height,
        "width": width,
        "channels": 3,
        "num_classes": num_classes,
    }


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check the ``meta.json`` of the memmap dataset in directory ``path``.

    Raises:
        FileNotFoundError: ``meta.json`` is missing.
        ValueError: it is not JSON, has the wrong ``format`` tag, misses keys or has bad values.
    """
    file = os.path.join(os.fspath(path), META_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"memmap face dataset file {file!r} is missing")
    try:
        with open(file, encoding="utf-8") as stream:
            meta = json.load(stream)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"cannot read {file!r} as JSON: {error}") from error
    if not isinstance(meta, dict):
        raise InputError(f"{file!r} must hold a JSON object, got {type(meta).__name__}")
    missing = [key for key in ("format", *_META_INTS) if key not in meta]
    if missing:
        raise InputError(f"{file!r} misses keys {missing!r}; expected keys {['format', *_META_INTS]!r}")
    if meta["format"] != FORMAT:
        raise InputError(f"{file!r} has `format` {meta['format']!r}; expected {FORMAT!r}")
    for key in _META_INTS:
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{file!r} has `{key}` {value!r}; expected a positive integer")
    if meta["channels"] != 3:
        raise InputError(f"{file!r} has `channels` {meta['channels']!r}; only 3 (RGB) is supported")
    return meta


def read_labels(path: str | os.PathLike[str], meta: dict[str, Any]) -> np.ndarray:
    """Read ``labels.npy`` of the dataset in ``path`` and check it against ``meta``.

    Raises:
        FileNotFoundError: ``labels.npy`` is missing.
        ValueError: unreadable, not 1-D integers, wrong length, or labels outside ``[0, num_classes)``.
    """
    file = os.path.join(os.fspath(path), LABELS_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"memmap face dataset file {file!r} is missing")
    try:
        labels = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise InputError(f"cannot read {file!r} as a .npy array: {error}") from error
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise InputError(f"{file!r} must hold a 1-D integer array, got {labels.dtype} of shape {labels.shape}")
    if labels.shape[0] != meta["count"]:
        raise InputError(f"{file!r} has {labels.shape[0]} labels but meta.json says `count` {meta['count']}")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= meta["num_classes"]:
        raise InputError(
            f"{file!r} has labels in [{low}, {high}], outside [0, {meta['num_classes']}) given by"
            " meta.json `num_classes`"
        )
    return labels.astype(np.int64, copy=False)


def check_images(path: str | os.PathLike[str], meta: dict[str, Any]) -> str:
    """Check that ``images.u8`` of the dataset in ``path`` has the size ``meta`` implies; return its path.

    Raises:
        FileNotFoundError: ``images.u8`` is missing.
        ValueError: its byte size is not ``count * height * width * 3``.
    """
    file = os.path.join(os.fspath(path), IMAGES_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"memmap face dataset file {file!r} is missing")
    shape = (meta["count"], meta["height"], meta["width"], meta["channels"])
    expected = int(np.prod(shape))
    actual = os.path.getsize(file)
    if actual != expected:
        raise InputError(
            f"{file!r} has {actual} bytes but meta.json describes uint8 images of shape {shape} ="
            f" {expected} bytes; the file is truncated or does not match meta.json"
        )
    return file


class MemmapFaceDataset(Dataset):
    """Face images read from an ``images.u8`` memmap; a sample is ``(CHW float in [-1, 1], label)``.

    The memmap is opened lazily, on the first read in each process, and never pickled, so
    DataLoader workers each map the file themselves.

    Args:
        images_file: the ``images.u8`` file.
        shape: its ``(count, height, width)``.
        labels: int64 [count], the label of every image in the file.
        indices: the rows of the file this dataset holds, in order (default: all).

    Raises:
        FileNotFoundError: ``images_file`` does not exist.
        TypeError: ``shape`` is not three integers.
        ValueError: the file's size does not match ``shape``, ``labels`` is not one integer per image,
            or an index is outside the file.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     file = os.path.join(folder, "images.u8")
        ...     np.full((2, 4, 4, 3), 255, dtype=np.uint8).tofile(file)
        ...     image, label = MemmapFaceDataset(file, (2, 4, 4), np.array([0, 1]))[1]
        >>> image.shape, float(image.max()), label
        (torch.Size([3, 4, 4]), 1.0, 1)
    """

    def __init__(
        self,
        images_file: str,
        shape: tuple[int, int, int],
        labels: np.ndarray,
        indices: np.ndarray | None = None,
    ) -> None:
        self.images_file = check_file("images_file", images_file)
        if isinstance(shape, str) or not isinstance(shape, Sequence) or len(shape) != 3:
            raise TypeError(f"`shape` must be (count, height, width), got {shape!r}")
        count, height, width = (check_int("shape", size, minimum=1) for size in shape)
        self.shape = (count, height, width)
        expected, actual = count * height * width * 3, os.path.getsize(self.images_file)
        if actual != expected:
            raise InputError(
                f"{self.images_file!r} has {actual} bytes, not the {expected} of `shape` {self.shape} × 3 channels"
            )
        labels = np.asarray(labels)
        if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
            raise InputError(f"`labels` must be {count} integers (one per image), got {labels.dtype} {labels.shape}")
        self.indices = np.arange(count) if indices is None else np.asarray(indices, dtype=np.int64)
        if self.indices.ndim != 1 or (self.indices.size and not 0 <= self.indices.min() <= self.indices.max() < count):
            raise InputError(f"`indices` must be a list of rows in [0, {count}), got {indices!r}")
        self.labels = labels.astype(np.int64)[self.indices]
        self._images: np.memmap | None = None

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_images"] = None  # each process maps the file itself
        return state

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if self._images is None:
            self._images = np.memmap(self.images_file, dtype=np.uint8, mode="r", shape=(*self.shape, 3))
        return to_face_tensor(self._images[self.indices[index]]), int(self.labels[index])


class MemmapFaceDataModule(FaceDataModule):
    """Face-recognition data from the memmap format: the fast path for large datasets.

    The directory is validated in ``__init__`` (files present, meta.json well-formed, image bytes
    and label count matching it, labels in range); images are read from a lazily opened memmap.

    Args:
        path: the dataset directory (``images.u8``, ``labels.npy``, ``meta.json``).
        num_classes: expected number of identities (checked against meta.json), or None to take it.
        image_size: expected height and width (checked against meta.json), or None to take them;
            configs set it so that a model config can read ``${data.image_size}``.
        val_fraction: fraction in [0, 1) of each identity's images held out for validation,
            chosen at random from ``seed``.
        seed: seed of the train/validation split.
        **kwargs: loader arguments of ``FaceDataModule`` (``batch_size``, ``augmentation`` …).

    Raises:
        FileNotFoundError: ``path`` or one of its files is missing.
        ValueError: a file does not match the format, ``num_classes`` or ``image_size`` differs
            from meta.json, or an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> import tempfile
        >>> from PIL import Image
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for name in ("alice", "bob"):
        ...         os.makedirs(os.path.join(tmp, "faces", name))
        ...         Image.new("RGB", (16, 16)).save(os.path.join(tmp, "faces", name, "0.png"))
        ...     _ = pack_image_folder(os.path.join(tmp, "faces"), os.path.join(tmp, "packed"))
        ...     dm = MemmapFaceDataModule(os.path.join(tmp, "packed"), batch_size=2)
        ...     images, labels = next(iter(dm.train_dataloader()))
        >>> dm.num_classes, images.shape
        (2, torch.Size([2, 3, 16, 16]))
    """

    def __init__(
        self,
        path: str,
        num_classes: int | None = None,
        image_size: int | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        path = check_directory("path", path, "memmap face dataset")
        num_classes = check_optional_int("num_classes", num_classes, minimum=1)
        image_size = check_optional_int("image_size", image_size, minimum=1)
        val_fraction, seed = check_split(val_fraction, seed)
        super().__init__(**kwargs)
        self.path = path
        self.meta = read_meta(self.path)
        self.images_file = check_images(self.path, self.meta)
        self.labels = read_labels(self.path, self.meta)
        meta_file = os.path.join(self.path, META_FILE)
        found = f"{meta_file!r} says {self.meta['num_classes']} identities"
        self.num_classes = check_class_count(num_classes, self.meta["num_classes"], found)
        height, width = self.meta["height"], self.meta["width"]
        if image_size is not None and (image_size, image_size) != (height, width):
            raise InputError(
                f"`image_size`={image_size!r} but {meta_file!r} describes {height}x{width} images;"
                " set `image_size` to match or to None"
            )
        self.image_size = height if height == width else None
        self.val_fraction = val_fraction
        self.seed = seed

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        shape = (self.meta["count"], self.meta["height"], self.meta["width"])

        def rows(indices: np.ndarray) -> MemmapFaceDataset:
            return MemmapFaceDataset(self.images_file, shape, self.labels, indices)

        return per_identity_datasets(self.labels, self.val_fraction, self.seed, rows)


def pack_image_folder(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], image_size: int | None = None
) -> dict[str, Any]:
    """Write the images of folder ``src`` to the memmap face format in directory ``dst``.

    Images go in scan order (identities sorted by folder name, files by name), one at a time, so
    memory use does not grow with the dataset. ``meta.json`` is written last: an interrupted
    pack leaves no valid dataset behind. Existing dataset files in ``dst`` are replaced.

    Args:
        src: the folder holding one sub-folder of images per identity.
        dst: the output directory (created if missing).
        image_size: resize every image (PIL bilinear) to this square size; None keeps the file
            size, which must then be the same for every image.

    Returns:
        The meta dict written to ``meta.json``.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: no identity folders, an identity folder without images, images of different
            sizes without ``image_size``, or ``image_size`` < 1.
        RuntimeError: an image cannot be decoded.

    Example::

        >>> import tempfile
        >>> from PIL import Image
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     os.makedirs(os.path.join(tmp, "faces", "alice"))
        ...     Image.new("RGB", (20, 10)).save(os.path.join(tmp, "faces", "alice", "0.png"))
        ...     src, dst = os.path.join(tmp, "faces"), os.path.join(tmp, "packed")
        ...     meta = pack_image_folder(src, dst, image_size=16)
        >>> meta["count"], meta["height"], meta["width"], meta["num_classes"]
        (1, 16, 16, 1)
    """
    if image_size is not None and image_size < 1:
        raise InputError(f"`image_size` must be at least 1 or None, got {image_size!r}")
    classes, samples = scan_image_folder(src)
    dataset = ImageFolderFaceDataset(samples, image_size)
    dst = os.fspath(dst)
    os.makedirs(dst, exist_ok=True)
    meta_file = os.path.join(dst, META_FILE)
    if os.path.exists(meta_file):
        os.remove(meta_file)
    with open(os.path.join(dst, IMAGES_FILE), "wb") as images:
        for index in range(len(dataset)):
            image, _ = dataset.load(index)
            images.write(image.tobytes())
    np.save(os.path.join(dst, LABELS_FILE), np.array([label for _, label in samples], dtype=np.int64))
    height, width = image.shape[:2]  # the dataset checked that all images share this size
    meta = make_meta(count=len(samples), height=height, width=width, num_classes=len(classes))
    with open(meta_file, "w", encoding="utf-8") as stream:
        json.dump(meta, stream, indent=2)
        stream.write("\n")
    return meta
