"""Face-recognition datamodules: synthetic, image folder and memmap, with their augmentation."""

from typing import Any

from lightning_memopt.data.augment import FaceAugmentation
from lightning_memopt.data.face_datamodule import FaceDataModule
from lightning_memopt.data.image_folder_face import ImageFolderFaceDataModule
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.memmap_face import MemmapFaceDataModule
from lightning_memopt.data.normals_folder import NormalsFolderDataModule
from lightning_memopt.data.synthetic_face import SyntheticFaceDataModule
from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataModule
from lightning_memopt.data.synthetic_tracking import SyntheticTrackingDataModule
from lightning_memopt.data.tracking_npz import TrackingNpzDataModule
from lightning_memopt.data.verification_pairs import PairDataset, verification_pairs

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
    # `pack` is imported on first use so `python -m lightning_memopt.data.pack` runs it only once.
    if name == "pack_image_folder":
        from lightning_memopt.data.pack import pack_image_folder

        return pack_image_folder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
