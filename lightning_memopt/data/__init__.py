"""Datamodules per task (synthetic and on-disk formats), face augmentation and verification pairs.

Each name is imported on its first use, so ``memopt-pack-faces --help`` (``lightning_memopt.cli.pack_faces``)
answers without importing torch or Lightning.

Example::

    >>> from lightning_memopt.data import SyntheticFaceDataModule
    >>> SyntheticFaceDataModule(num_classes=4, image_size=32, batch_size=2).num_classes
    4
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports each name on first use
    from lightning_memopt.data.augment import FaceAugmentation
    from lightning_memopt.data.face_datamodule import FaceDataModule
    from lightning_memopt.data.image_folder_face import ImageFolderFaceDataModule
    from lightning_memopt.data.loader_datamodule import LoaderDataModule
    from lightning_memopt.data.memmap_face import MemmapFaceDataModule, pack_image_folder
    from lightning_memopt.data.normals_folder import NormalsFolderDataModule
    from lightning_memopt.data.pairs import PairDataset, verification_pairs
    from lightning_memopt.data.synthetic_face import SyntheticFaceDataModule
    from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataModule
    from lightning_memopt.data.synthetic_tracking import SyntheticTrackingDataModule
    from lightning_memopt.data.tracking_npz import TrackingNpzDataModule

# public name -> the submodule it is imported from on first use
_LAZY = {
    "FaceAugmentation": "augment",
    "FaceDataModule": "face_datamodule",
    "ImageFolderFaceDataModule": "image_folder_face",
    "LoaderDataModule": "loader_datamodule",
    "MemmapFaceDataModule": "memmap_face",
    "NormalsFolderDataModule": "normals_folder",
    "PairDataset": "pairs",
    "SyntheticFaceDataModule": "synthetic_face",
    "SyntheticNormalsDataModule": "synthetic_normals",
    "SyntheticTrackingDataModule": "synthetic_tracking",
    "TrackingNpzDataModule": "tracking_npz",
    "pack_image_folder": "memmap_face",
    "verification_pairs": "pairs",
}

__all__ = [
    "FaceAugmentation",
    "FaceDataModule",
    "ImageFolderFaceDataModule",
    "LoaderDataModule",
    "MemmapFaceDataModule",
    "NormalsFolderDataModule",
    "PairDataset",
    "SyntheticFaceDataModule",
    "SyntheticNormalsDataModule",
    "SyntheticTrackingDataModule",
    "TrackingNpzDataModule",
    "pack_image_folder",
    "verification_pairs",
]


def __getattr__(name: str) -> Any:
    """Import a public name on its first use; ``AttributeError`` for any other."""
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later uses do not come back here
    return value


def __dir__() -> list[str]:
    """The module's names, the public ones not yet imported included."""
    return sorted({*globals(), *__all__})
