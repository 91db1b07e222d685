"""Pack an image folder (one sub-folder per identity) into the memmap face format.

Command line: ``memopt-pack-faces SRC DST [--image-size N]`` (:mod:`lightning_memopt.cli.pack_faces`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from lightning_memopt.arguments import InputError

# The datasets (torch) are imported by `pack_image_folder`, not with this module, so that `memopt-pack-faces`
# parses and answers `--help` before torch is loaded.


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
    from lightning_memopt.data.image_folder_face import ImageFolderFaceDataset, scan_image_folder
    from lightning_memopt.data.memmap_face import IMAGES_FILE, LABELS_FILE, META_FILE, make_meta

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
