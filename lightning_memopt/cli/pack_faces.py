"""``memopt-pack-faces``: pack a face image folder (one sub-folder per identity) into the memmap face format.

Command line: ``memopt-pack-faces SRC DST [--image-size N]`` or
``python -m lightning_memopt.cli.pack_faces SRC DST [--image-size N]``. Importing this module loads
neither torch nor Lightning, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_memopt.cli.errors import input_errors


def main(argv: Sequence[str] | None = None) -> int:
    """Pack ``SRC`` into ``DST`` (:func:`~lightning_memopt.data.memmap_face.pack_image_folder`); print a summary.

    Returns 0, or exits with status 2 for a bad input.

    Example::

        >>> import os, tempfile
        >>> from PIL import Image
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     os.makedirs(os.path.join(tmp, "faces", "alice"))
        ...     Image.new("RGB", (16, 16)).save(os.path.join(tmp, "faces", "alice", "0.png"))
        ...     code = main([os.path.join(tmp, "faces"), os.path.join(tmp, "packed")])  # doctest: +ELLIPSIS
        packed 1 images of 16x16 from 1 identities into .../packed
    """
    parser = argparse.ArgumentParser(
        prog="memopt-pack-faces",
        description="Pack a face image folder (one sub-folder per identity) into the memmap face format.",
    )
    parser.add_argument("src", help="folder with one sub-folder of images per identity")
    parser.add_argument("dst", help="output directory (images.u8, labels.npy, meta.json)")
    parser.add_argument(
        "--image-size", type=int, default=None, metavar="N", help="resize images to N x N (PIL bilinear)"
    )
    args = parser.parse_args(argv)
    from lightning_memopt.data.memmap_face import pack_image_folder  # (torch: once the arguments are read)

    with input_errors("memopt-pack-faces", building=True):  # a bad folder or image: one line, exit status 2
        meta = pack_image_folder(args.src, args.dst, image_size=args.image_size)
    print(
        f"packed {meta['count']} images of {meta['height']}x{meta['width']} from {meta['num_classes']}"
        f" identities into {args.dst}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
