"""Surface normals on disk: ``images/<name>.png|jpg``, ``normals/<name>.npy``, optional ``masks/<name>.png``.

Layout (the Sapiens fine-tuning layout)::

    root/images/<name>.png    RGB image (.png, .jpg or .jpeg)
    root/normals/<name>.npy   float H × W × 3 unit normals (x right, y up, z towards the camera)
    root/masks/<name>.png     optional; nonzero = valid pixel

A pixel is valid where the mask (if any) is nonzero and its normal is finite and nonzero; valid
normals must have unit length within ``unit_tolerance`` (they are then renormalised exactly).

A sample (the format of the synthetic normals too, :func:`normals_sample`) is a dict of three tensors:

- ``image``: float32 ``[3, H, W]``, RGB in [0, 1] normalised with the ImageNet mean and std (the
  normalisation of the Sapiens pre-training);
- ``normal``: float32 ``[3, H, W]``, unit vectors in camera coordinates, x right, y up, z towards the
  camera (a surface facing the camera has normal (0, 0, 1)); zero outside the mask;
- ``mask``: bool ``[1, H, W]``, True where the normal is defined.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import InputError, check_fraction, check_int, check_path
from lightning_memopt.data.checks import check_directory, check_extensions, check_optional_size_pair
from lightning_memopt.data.image_folder_face import image_size_of, list_image_files, load_face_image
from lightning_memopt.data.loader_datamodule import LoaderDataModule

IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


def normals_sample(image: Tensor, normal: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Assemble a sample from an RGB image in [0, 1], a normal map and a validity mask.

    Args:
        image: float ``[3, H, W]`` in [0, 1].
        normal: float ``[3, H, W]``, unit vectors where ``mask`` is True (zeroed elsewhere).
        mask: bool ``[H, W]`` or ``[1, H, W]``.

    Example::

        >>> mask = torch.tensor([[True, False], [True, True]])
        >>> sample = normals_sample(torch.ones(3, 2, 2), torch.ones(3, 2, 2), mask)
        >>> [round(v, 4) for v in sample["image"][:, 0, 0].tolist()], sample["normal"][:, 0, 1].tolist()
        ([2.2489, 2.4286, 2.64], [0.0, 0.0, 0.0])
        >>> sample["mask"].shape
        torch.Size([1, 2, 2])
    """
    mask = mask.reshape(1, *normal.shape[-2:]).bool()
    mean = torch.tensor(IMAGE_MEAN, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD, dtype=torch.float32).view(3, 1, 1)
    return {
        "image": (image.float() - mean) / std,
        "normal": normal.float().masked_fill(~mask, 0.0),
        "mask": mask,
    }


DEFAULT_EXTENSIONS = (".png", ".jpg", ".jpeg")
_MIN_RESIZED_NORM = 0.5  # after resizing, pixels mostly made of invalid neighbours become invalid


class NormalsFiles(NamedTuple):
    """The files of one sample; ``mask`` is None when there is no mask file."""

    image: str
    normal: str
    mask: str | None


def scan_normals_folder(
    root: str | os.PathLike[str], extensions: Sequence[str] = DEFAULT_EXTENSIONS
) -> list[NormalsFiles]:
    """List the samples of a normals folder, sorted by name.

    Every image in ``root/images`` needs ``root/normals/<stem>.npy``; ``root/masks/<stem>.png`` is
    used when it exists. Names starting with ``.`` are skipped; extensions match case-insensitively.

    Raises:
        FileNotFoundError: ``root/images`` does not exist, or an image has no normals file.
        ValueError: ``root/images`` holds no image.

    Example::

        >>> scan_normals_folder("/no/such")
        Traceback (most recent call last):
        ...
        FileNotFoundError: normals folder '/no/such' has no `images` sub-folder (expected '/no/such/images')
    """
    root = check_path("root", root)
    images = os.path.join(root, "images")
    if not os.path.isdir(images):
        raise FileNotFoundError(f"normals folder {root!r} has no `images` sub-folder (expected {images!r})")
    suffixes = tuple(extension.lower() for extension in check_extensions("extensions", extensions))
    names = list_image_files(images, suffixes)
    if not names:
        raise InputError(f"{images!r} has no image files (extensions {list(suffixes)!r})")
    samples = []
    for name in names:
        stem = os.path.splitext(name)[0]
        normal = os.path.join(root, "normals", f"{stem}.npy")
        if not os.path.isfile(normal):
            raise FileNotFoundError(f"image {os.path.join(images, name)!r} has no normals file {normal!r}")
        mask = os.path.join(root, "masks", f"{stem}.png")
        samples.append(NormalsFiles(os.path.join(images, name), normal, mask if os.path.isfile(mask) else None))
    return samples


def _read_normal_map(files: NormalsFiles, height: int, width: int) -> np.ndarray:
    try:
        normal = np.load(files.normal, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise RuntimeError(f"cannot read normals {files.normal!r}: {error}") from error
    if normal.shape != (height, width, 3):
        expected = f"(H, W, 3) = ({height}, {width}, 3)"
        raise InputError(f"{files.normal} has shape {normal.shape}, expected {expected} to match {files.image}")
    if not np.issubdtype(normal.dtype, np.floating):
        raise InputError(f"{files.normal} has dtype {normal.dtype}, expected floating-point unit normals")
    return normal.astype(np.float32)


def load_normals_files(files: NormalsFiles, unit_tolerance: float = 1e-2) -> tuple[Tensor, Tensor, Tensor]:
    """Read one sample: ``(image [3, H, W] in [0, 1], unit normals [3, H, W], valid mask [H, W])``.

    Raises:
        RuntimeError: a file cannot be decoded.
        ValueError: the normals or the mask do not match the image size, the normals are not floats,
            or a valid normal's length is off 1 by more than ``unit_tolerance``; the message names the file.
    """
    image = load_face_image(files.image, None)
    height, width = image.shape[:2]
    normal = _read_normal_map(files, height, width)
    valid = np.isfinite(normal).all(axis=2)
    length = np.linalg.norm(np.where(valid[..., None], normal, 0.0), axis=2)
    valid &= length > 0
    if files.mask is not None:
        mask = load_face_image(files.mask, None).any(axis=2)
        if mask.shape != (height, width):
            raise InputError(
                f"{files.mask} has shape {mask.shape}, expected (H, W) = ({height}, {width}) to match {files.image}"
            )
        valid &= mask
    deviation = np.where(valid, np.abs(length - 1.0), 0.0)
    if deviation.max(initial=0.0) > unit_tolerance:
        row, col = np.unravel_index(deviation.argmax(), deviation.shape)
        raise InputError(
            f"{files.normal} holds a normal of length {length[row, col]:.4g} at pixel (row {row}, column {col});"
            f" valid normals must have unit length within `unit_tolerance`={unit_tolerance!r}"
        )
    unit = np.where(valid[..., None], normal / np.maximum(length, 1e-12)[..., None], 0.0)
    image_chw = torch.from_numpy(image.transpose(2, 0, 1) / np.float32(255.0))
    return image_chw, torch.from_numpy(unit).permute(2, 0, 1).float(), torch.from_numpy(valid)


def resize_normals_sample(image: Tensor, normal: Tensor, mask: Tensor, size: Sequence[int]) -> tuple[Tensor, ...]:
    """Resize ``(image [3, H, W], normal [3, H, W], mask [H, W])`` to ``size = (H', W')``.

    The image is resized bilinearly (antialiased), the normals bilinearly and renormalised, the mask
    by nearest neighbour; a pixel stays valid where its resized normal keeps at least half its length.

    Example::

        >>> up = torch.tensor([0.0, 0.0, 1.0]).view(3, 1, 1).expand(3, 4, 4)
        >>> valid = torch.ones(4, 4, dtype=torch.bool)
        >>> image, normal, mask = resize_normals_sample(torch.ones(3, 4, 4), up, valid, (2, 2))
        >>> image.shape, normal[:, 1, 1].tolist(), mask.tolist()
        (torch.Size([3, 2, 2]), [0.0, 0.0, 1.0], [[True, True], [True, True]])
    """
    size = (int(size[0]), int(size[1]))
    if tuple(image.shape[-2:]) == size:
        return image, normal, mask
    image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]
    normal = F.interpolate(normal[None], size=size, mode="bilinear", align_corners=False)[0]
    mask = F.interpolate(mask[None, None].float(), size=size, mode="nearest")[0, 0] > 0
    length = normal.norm(dim=0)
    mask &= length >= _MIN_RESIZED_NORM
    return image.clamp(0.0, 1.0), torch.where(mask, normal / length.clamp(min=1e-12), 0.0), mask


class NormalsFolderDataset(Dataset):
    """Samples of a normals folder, read when indexed, as sample dicts of ``normals_sample``.

    Args:
        files: the samples (see :func:`scan_normals_folder`).
        image_size: ``(H, W)`` to resize every sample to; None keeps file sizes, which must then all
            equal that of ``files[0]``'s image.
        unit_tolerance: largest accepted ``| |n| − 1 |`` of a valid normal.

    Raises:
        TypeError: ``image_size`` is not ``(H, W)`` or ``unit_tolerance`` not a number.
        ValueError: ``image_size`` or ``unit_tolerance`` is out of range; when a sample is read,
            ``image_size`` is None and its image has another size than the first, or the errors of
            :func:`load_normals_files`.
    """

    def __init__(
        self, files: Sequence[NormalsFiles], image_size: Sequence[int] | None = None, unit_tolerance: float = 1e-2
    ) -> None:
        self.files = list(files)
        self.image_size = check_optional_size_pair("image_size", image_size)
        self.unit_tolerance = check_fraction("unit_tolerance", unit_tolerance, open_minimum=True, open_maximum=True)
        self._reference_size: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        files = self.files[index]
        image, normal, mask = load_normals_files(files, self.unit_tolerance)
        if self.image_size is not None:
            return normals_sample(*resize_normals_sample(image, normal, mask, self.image_size))
        if self._reference_size is None:
            width, height = image_size_of(self.files[0].image)
            self._reference_size = (height, width)
        if tuple(image.shape[-2:]) != self._reference_size:
            raise InputError(
                f"{files.image} is {image.shape[-2]}x{image.shape[-1]} (H x W) but {self.files[0].image} is"
                f" {self._reference_size[0]}x{self._reference_size[1]}; all images must share one size,"
                " or set `image_size` to resize them"
            )
        return normals_sample(image, normal, mask)


class NormalsFolderDataModule(LoaderDataModule):
    """Surface-normal data from a folder of images, ``.npy`` normal maps and optional masks.

    The folder is scanned in ``__init__`` (a missing normals file is an error right away); files are
    decoded when read, and a bad file raises an error naming it and the expected shape.

    Args:
        root: the folder with ``images/``, ``normals/`` and optionally ``masks/``.
        image_size: ``(H, W)`` to resize samples to (1024 × 768 for Sapiens); None keeps file sizes,
            which must then all be equal.
        val_fraction: fraction in [0, 1) of the samples held out for validation, chosen from ``seed``.
        seed: seed of the train/validation split.
        unit_tolerance: largest accepted ``| |n| − 1 |`` of a valid normal, in (0, 1).
        extensions: file name endings counted as images (case-insensitive).
        **kwargs: loader arguments of ``LoaderDataModule`` (``batch_size``, ``num_workers`` …).

    Raises:
        FileNotFoundError: ``root``, ``root/images`` or a normals file is missing.
        ValueError: no images, or an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> import tempfile
        >>> from PIL import Image
        >>> with tempfile.TemporaryDirectory() as root:
        ...     for folder in ("images", "normals"):
        ...         os.makedirs(os.path.join(root, folder))
        ...     for name in ("a", "b"):
        ...         Image.new("RGB", (6, 8)).save(os.path.join(root, "images", f"{name}.png"))
        ...         np.save(os.path.join(root, "normals", f"{name}.npy"), np.tile(np.float32([0, 0, 1]), (8, 6, 1)))
        ...     batch = next(iter(NormalsFolderDataModule(root, image_size=(4, 3), batch_size=2).train_dataloader()))
        >>> batch["normal"].shape, bool(batch["mask"].all())
        (torch.Size([2, 3, 4, 3]), True)
    """

    def __init__(
        self,
        root: str,
        image_size: Sequence[int] | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
        unit_tolerance: float = 1e-2,
        extensions: Sequence[str] = DEFAULT_EXTENSIONS,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        root = check_directory("root", root, "normals folder")
        size = check_optional_size_pair("image_size", image_size)
        val_fraction = check_fraction("val_fraction", val_fraction, open_maximum=True)
        seed = check_int("seed", seed, minimum=0)
        unit_tolerance = check_fraction("unit_tolerance", unit_tolerance, open_minimum=True, open_maximum=True)
        check_extensions("extensions", extensions)
        super().__init__(**kwargs)
        self.root = root
        self.files = scan_normals_folder(self.root, extensions)
        self.image_size = size
        self.val_fraction = val_fraction
        self.seed = seed
        self.unit_tolerance = unit_tolerance

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        order = np.random.default_rng(self.seed).permutation(len(self.files))
        num_val = min(round(len(self.files) * self.val_fraction), len(self.files) - 1)
        train = [self.files[i] for i in sorted(order[num_val:])]
        val = [self.files[i] for i in sorted(order[:num_val])]
        train_dataset = NormalsFolderDataset(train, self.image_size, self.unit_tolerance)
        if not val:
            return train_dataset, None
        return train_dataset, NormalsFolderDataset(val, self.image_size, self.unit_tolerance)
