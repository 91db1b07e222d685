"""Point-tracking clips stored as ``.npz`` files, their validation and their datamodule.

A clip is one ``.npz`` archive holding three arrays:

- ``video``: uint8 ``T×H×W×3`` (RGB);
- ``tracks``: float ``T×N×2``, ``(x, y)`` in pixels, pixel centres at integer coordinates;
- ``visibility``: bool ``T×N`` (integer or float 0 / 1 is accepted too).

Visible points must lie in the frame and points marked invisible not far outside it (the bounds of
:func:`~lightning_memopt.data.tracking_sample.check_track_positions`).

A dataset is a directory of such clips (``*.npz``, read in sorted order); the clips of a dataset
share ``H×W`` so that they batch (a batch of clips of different sizes is an error naming their files).
Each sample is a crop of ``sequence_len`` frames (the start drawn from ``(seed, index)``) with
``traj_per_sample`` tracks chosen as :mod:`lightning_memopt.data.tracking_sample` says: a clip with
fewer visible tracks repeats them.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_memopt.arguments import InputError, check_int, check_optional_int, check_path
from lightning_memopt.data.checks import check_directory, check_split
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.data.tracking_sample import check_track_positions, collate_tracking_samples, tracking_sample

ARRAYS = ("video", "tracks", "visibility")
EXPECTED = "`video` uint8 T×H×W×3, `tracks` float T×N×2 and `visibility` bool T×N"


def write_tracking_clip(
    path: str | os.PathLike[str], video: np.ndarray, tracks: np.ndarray, visibility: np.ndarray
) -> None:
    """Save a clip in the ``.npz`` format (no checks: :func:`read_tracking_clip` checks on reading).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     file = os.path.join(folder, "clip.npz")
        ...     write_tracking_clip(file, np.zeros((2, 4, 4, 3), np.uint8), np.zeros((2, 1, 2)), np.ones((2, 1), bool))
        ...     video, tracks, visibility = read_tracking_clip(file)
        >>> video.shape, tracks.dtype, visibility.dtype
        ((2, 4, 4, 3), dtype('float32'), dtype('bool'))
    """
    np.savez(path, video=video, tracks=tracks, visibility=visibility)


def read_tracking_clip(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read and check one clip: ``(video uint8 T×H×W×3, tracks float32 T×N×2, visibility bool T×N)``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not a readable ``.npz`` (truncated, corrupt), misses an array, an array has the
            wrong dtype or shape, ``visibility`` holds values other than 0 / 1, or a position is not finite,
            visible outside the frame or invisible far outside it; the message names the file.
    """
    file = os.fspath(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"tracking clip {file!r} does not exist")
    try:
        archive = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise InputError(
            f"cannot read {file!r} as a .npz archive ({error}); a tracking clip holds {EXPECTED}"
        ) from error
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise InputError(f"{file!r} holds a single array, not a .npz archive; a tracking clip holds {EXPECTED}")
    with archive:
        missing = [name for name in ARRAYS if name not in archive.files]
        if missing:
            raise InputError(f"{file!r} misses the arrays {missing!r}; a tracking clip holds {EXPECTED}")
        try:
            video, tracks, visibility = (archive[name] for name in ARRAYS)
        except Exception as error:  # zlib, zipfile and .npy header errors of a truncated or corrupt member
            raise InputError(
                f"cannot read {file!r}: an array in it is truncated or corrupt ({type(error).__name__}: {error});"
                f" a tracking clip holds {EXPECTED}"
            ) from error
    if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
        raise InputError(f"{file!r}: `video` must be uint8 T×H×W×3, got {video.dtype} of shape {video.shape}")
    frames = video.shape[0]
    if not np.issubdtype(tracks.dtype, np.floating) or tracks.ndim != 3 or tracks.shape[::2] != (frames, 2):
        raise InputError(
            f"{file!r}: `tracks` must be float T×N×2 with T = {frames} (the frames of `video`),"
            f" got {tracks.dtype} of shape {tracks.shape}"
        )
    is_number = any(np.issubdtype(visibility.dtype, kind) for kind in (np.bool_, np.integer, np.floating))
    if not is_number or visibility.shape != tracks.shape[:2]:
        raise InputError(
            f"{file!r}: `visibility` must be bool T×N = {tracks.shape[:2]} (the frames and tracks of `tracks`),"
            f" got {visibility.dtype} of shape {visibility.shape}"
        )
    if visibility.dtype != bool:
        bad = ~np.isin(visibility, (0, 1))  # NaN included
        if bad.any():
            values = np.unique(visibility[bad])
            shown = ", ".join(f"{value:g}" for value in values[:5].tolist()) + (" …" if values.size > 5 else "")
            raise InputError(
                f"{file!r}: `visibility` must be bool, or {visibility.dtype} holding only 0 and 1, but"
                f" {int(bad.sum())} entries hold other values: {shown}"
            )
    visibility = visibility.astype(bool)
    check_track_positions(tracks, visibility, video.shape[1], video.shape[2], source=repr(file))
    return video, tracks.astype(np.float32), visibility


class TrackingNpzDataset(Dataset):
    """Samples from ``.npz`` clips, one per file; a clip is read and checked when its sample is read.

    Args:
        files: the clip files.
        traj_per_sample: tracks per sample.
        sequence_len: frames per sample (a crop), or None for whole clips.
        seed: seed of the crops and of the choice of tracks (sample ``i`` depends on ``(seed, i)``).

    Raises:
        TypeError: ``files`` is not a list of paths, or an argument has the wrong kind.
        ValueError: an argument is out of range; when a sample is read, the errors of
            :func:`read_tracking_clip`, a clip shorter than ``sequence_len`` or without visible tracks.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     file = os.path.join(folder, "clip.npz")
        ...     write_tracking_clip(file, np.zeros((5, 8, 8, 3), np.uint8), np.ones((5, 2, 2)), np.ones((5, 2), bool))
        ...     sample = TrackingNpzDataset([file], traj_per_sample=3, sequence_len=4, seed=0)[0]
        >>> sample["video"].shape, sample["tracks"].shape
        (torch.Size([4, 3, 8, 8]), torch.Size([4, 3, 2]))
    """

    def __init__(self, files: list[str], traj_per_sample: int, sequence_len: int | None, seed: int) -> None:
        if isinstance(files, str | os.PathLike) or not isinstance(files, Sequence):
            raise TypeError(f"`files` must be a list of clip files, got {files!r} ({type(files).__name__})")
        self.files = [check_path("files", file) for file in files]
        self.traj_per_sample = check_int("traj_per_sample", traj_per_sample, minimum=1)
        self.sequence_len = check_optional_int("sequence_len", sequence_len, minimum=2)
        self.seed = check_int("seed", seed, minimum=0)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        file = self.files[index]
        video, tracks, visibility = read_tracking_clip(file)
        rng = np.random.default_rng([self.seed, index])
        frames = video.shape[0]
        length = frames if self.sequence_len is None else self.sequence_len
        if frames < length:
            raise InputError(f"{file!r} has {frames} frames, fewer than `sequence_len`={length!r}")
        start = int(rng.integers(frames - length + 1))
        crop = slice(start, start + length)
        frames_tensor = torch.from_numpy(np.ascontiguousarray(video[crop])).permute(0, 3, 1, 2).float()
        try:
            return tracking_sample(frames_tensor, tracks[crop], visibility[crop], self.traj_per_sample, rng, file)
        except ValueError as error:
            raise InputError(f"{file!r}, frames {start}…{start + length - 1}: {error}") from error


class TrackingNpzDataModule(LoaderDataModule):
    """Point-tracking data from a directory of ``.npz`` clips (e.g. Kubric MOVi-F converted to this format).

    Args:
        root: the directory of ``*.npz`` clips.
        traj_per_sample: tracks per sample, at least 1 (768 for CoTracker2, 384 for CoTracker3).
        sequence_len: frames per sample, a crop of each clip, or None for whole clips.
        val_fraction: fraction in [0, 1) of the clips held out for validation, chosen at random from
            ``seed`` (at least one clip stays for training).
        seed: seed of the split, the crops and the choice of tracks.
        **kwargs: loader arguments of ``LoaderDataModule`` (``batch_size``, ``num_workers`` …).

    Raises:
        FileNotFoundError: ``root`` is not a directory or holds no ``.npz`` file.
        ValueError: an argument is out of range.
        TypeError: an argument has the wrong kind.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     for name in ("a", "b"):
        ...         clip = (np.zeros((4, 8, 8, 3), np.uint8), np.ones((4, 3, 2)), np.ones((4, 3), bool))
        ...         write_tracking_clip(os.path.join(folder, f"{name}.npz"), *clip)
        ...     dm = TrackingNpzDataModule(folder, traj_per_sample=2, val_fraction=0.5, batch_size=1)
        ...     batch = next(iter(dm.train_dataloader()))
        >>> batch["tracks"].shape, len(dm.val_dataset)
        (torch.Size([1, 4, 2, 2]), 1)
    """

    def __init__(
        self,
        root: str,
        traj_per_sample: int = 256,
        sequence_len: int | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        # Checked before the base class saves the arguments as hyperparameters, so it saves the checked values.
        root = check_directory("root", root, "tracking dataset")
        traj_per_sample = check_int("traj_per_sample", traj_per_sample, minimum=1)
        sequence_len = check_optional_int("sequence_len", sequence_len, minimum=2)
        val_fraction, seed = check_split(val_fraction, seed)
        super().__init__(**kwargs)
        # Clips of different sizes in one batch: an error naming their files and sizes.
        self.loader_options["collate_fn"] = collate_tracking_samples
        self.files = sorted(str(path) for path in Path(root).glob("*.npz"))
        if not self.files:
            raise FileNotFoundError(f"tracking dataset `root` {root!r} holds no .npz clip; each holds {EXPECTED}")
        self.traj_per_sample = traj_per_sample
        self.sequence_len = sequence_len
        self.val_fraction = val_fraction
        self.seed = seed

    def _build_datasets(self) -> tuple[Dataset, Dataset | None]:
        count = len(self.files)
        num_val = min(round(count * self.val_fraction), count - 1)
        is_val = np.zeros(count, dtype=bool)
        is_val[np.random.default_rng(self.seed).permutation(count)[:num_val]] = True

        def dataset(held_out: bool) -> TrackingNpzDataset:
            files = [file for file, val in zip(self.files, is_val, strict=True) if val == held_out]
            return TrackingNpzDataset(files, self.traj_per_sample, self.sequence_len, self.seed)

        return dataset(held_out=False), dataset(held_out=True) if num_val else None
