import json
import re

import numpy as np
import pytest
from PIL import Image

from lightning_memopt.cli.pack_faces import main
from lightning_memopt.data import pack_image_folder
from tests.helpers import write_face_folder


def test_writes_the_memmap_format(tmp_path):
    src = write_face_folder(tmp_path / "faces", {"b": 2, "a": 1}, size=(16, 12))
    meta = pack_image_folder(src, tmp_path / "packed")
    assert meta == {
        "format": "lightning_memopt.faces.v1",
        "count": 3,
        "height": 12,
        "width": 16,
        "channels": 3,
        "num_classes": 2,
    }
    assert json.loads((tmp_path / "packed" / "meta.json").read_text()) == meta
    labels = np.load(tmp_path / "packed" / "labels.npy")
    assert labels.dtype == np.int64 and labels.tolist() == [0, 1, 1]
    files = [src / "a" / "000.png", src / "b" / "000.png", src / "b" / "001.png"]
    expected = b"".join(np.asarray(Image.open(file).convert("RGB")).tobytes() for file in files)
    assert (tmp_path / "packed" / "images.u8").read_bytes() == expected


def test_resizes_to_image_size(tmp_path):
    src = write_face_folder(tmp_path / "faces", {"a": 1}, size=(30, 20))
    write_face_folder(src, {"b": 1}, size=(17, 17))
    meta = pack_image_folder(src, tmp_path / "packed", image_size=16)
    assert (meta["height"], meta["width"], meta["count"]) == (16, 16, 2)
    assert (tmp_path / "packed" / "images.u8").stat().st_size == 2 * 16 * 16 * 3
    resized = Image.open(src / "a" / "000.png").convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
    assert (tmp_path / "packed" / "images.u8").read_bytes()[: 16 * 16 * 3] == np.asarray(resized).tobytes()


def test_mixed_sizes_without_image_size_raise(tmp_path):
    src = write_face_folder(tmp_path / "faces", {"a": 1})
    write_face_folder(src, {"b": 1}, size=(20, 16))
    odd = re.escape(str(src / "b" / "000.png"))
    with pytest.raises(ValueError, match=rf"image '{odd}' is 20x16 but .* is 16x16"):
        pack_image_folder(src, tmp_path / "packed")
    assert not (tmp_path / "packed" / "meta.json").exists()


def test_corrupt_image_raises_and_leaves_no_meta(tmp_path):
    src = write_face_folder(tmp_path / "faces", {"a": 2})
    pack_image_folder(src, tmp_path / "packed")
    (src / "a" / "001.png").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match=rf"cannot read image '{re.escape(str(src / 'a' / '001.png'))}'"):
        pack_image_folder(src, tmp_path / "packed")
    assert not (tmp_path / "packed" / "meta.json").exists()


def test_folder_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`root` '.*missing' does not exist"):
        pack_image_folder(tmp_path / "missing", tmp_path / "packed")
    (tmp_path / "faces" / "empty").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"identity folder '.*empty' has no image files"):
        pack_image_folder(tmp_path / "faces", tmp_path / "packed")


def test_bad_image_size_raises(tmp_path):
    with pytest.raises(ValueError, match=r"`image_size` must be at least 1 or None, got 0"):
        pack_image_folder(tmp_path, tmp_path / "packed", image_size=0)


def test_repacking_replaces_the_dataset(tmp_path):
    pack_image_folder(write_face_folder(tmp_path / "big", {"a": 3, "b": 3}), tmp_path / "packed")
    meta = pack_image_folder(write_face_folder(tmp_path / "small", {"a": 1}), tmp_path / "packed")
    assert meta["count"] == 1
    assert (tmp_path / "packed" / "images.u8").stat().st_size == 16 * 16 * 3
    assert np.load(tmp_path / "packed" / "labels.npy").tolist() == [0]


def test_cli_prints_a_summary(tmp_path, capsys):
    src = write_face_folder(tmp_path / "faces", {"a": 2, "b": 1, "c": 1}, size=(20, 20))
    dst = tmp_path / "packed"
    assert main([str(src), str(dst), "--image-size", "16"]) == 0
    assert capsys.readouterr().out == f"packed 4 images of 16x16 from 3 identities into {dst}\n"
    assert json.loads((dst / "meta.json").read_text())["count"] == 4


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["only-one-argument"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: dst" in capsys.readouterr().err
