import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from lightning_memopt.data import ImageFolderFaceDataModule
from lightning_memopt.data.image_folder_face import ImageFolderFaceDataset, scan_image_folder
from tests.helpers import write_face_folder

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def expected_tensor(path: Path) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float()
    return (pixels / 255 - 0.5) / 0.5


def test_labels_follow_sorted_folder_names(tmp_path):
    write_face_folder(tmp_path, {"carol": 1, "alice": 2, "bob": 3})
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=2)
    assert dm.num_classes == 3
    assert dm.classes == ["alice", "bob", "carol"]
    assert [label for _, label in dm.samples] == [0, 0, 1, 1, 1, 2]
    assert [Path(path).parent.name for path, _ in dm.samples] == ["alice"] * 2 + ["bob"] * 3 + ["carol"]


def test_samples_are_exact_normalised_pixels(tmp_path):
    write_face_folder(tmp_path, {"a": 2, "b": 2})
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=2)
    for index, (path, label) in enumerate(dm.samples):
        image, got_label = dm.train_dataset[index]
        assert image.dtype == torch.float32 and image.shape == (3, 16, 16)
        assert torch.equal(image, expected_tensor(Path(path))) and got_label == label
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 16) and labels.dtype == torch.int64


def test_resizes_to_image_size_with_pil_bilinear(tmp_path):
    write_face_folder(tmp_path, {"a": 1}, size=(24, 20))
    dm = ImageFolderFaceDataModule(str(tmp_path), image_size=16, batch_size=1)
    image, _ = dm.train_dataset[0]
    resized = Image.open(dm.samples[0][0]).convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
    pixels = torch.from_numpy(np.array(resized)).permute(2, 0, 1).float()
    assert torch.equal(image, (pixels / 255 - 0.5) / 0.5)


def test_grayscale_images_become_rgb(tmp_path):
    (tmp_path / "a").mkdir()
    Image.new("L", (16, 16), color=255).save(tmp_path / "a" / "0.png")
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=1)
    assert torch.equal(dm.train_dataset[0][0], torch.ones(3, 16, 16))


def test_mixed_sizes_without_image_size_raise_naming_the_file(tmp_path):
    write_face_folder(tmp_path, {"a": 1})
    write_face_folder(tmp_path, {"b": 1}, size=(20, 16))
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=1)
    dm.train_dataset[0]
    odd = tmp_path / "b" / "000.png"
    with pytest.raises(ValueError, match=rf"image '{re.escape(str(odd))}' is 20x16 but '.*000.png' is 16x16"):
        dm.train_dataset[1]
    resized = ImageFolderFaceDataModule(str(tmp_path), image_size=16, batch_size=1)
    assert resized.train_dataset[1][0].shape == (3, 16, 16)


def test_hidden_entries_and_other_extensions_are_skipped(tmp_path):
    write_face_folder(tmp_path, {"a": 1, ".cache": 1})
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "a" / ".hidden.png").write_bytes(b"")
    (tmp_path / "README").write_text("not a folder")
    Image.new("RGB", (16, 16)).save(tmp_path / "a" / "UPPER.JPG", format="JPEG")
    classes, samples = scan_image_folder(tmp_path)
    assert classes == ["a"]
    assert [Path(path).name for path, _ in samples] == ["000.png", "UPPER.JPG"]
    _, only_png = scan_image_folder(tmp_path, extensions=(".png",))
    assert len(only_png) == 1


def test_val_split_is_deterministic_disjoint_and_per_identity(tmp_path):
    write_face_folder(tmp_path, {"a": 10, "b": 5, "c": 1})
    kwargs = {"val_fraction": 0.4, "batch_size": 2}

    def split(seed):
        dm = ImageFolderFaceDataModule(str(tmp_path), seed=seed, **kwargs)
        return dm.train_dataset.samples, dm.val_dataset.samples

    train, val = split(seed=0)
    assert split(seed=0) == (train, val)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(scan_image_folder(tmp_path)[1])
    assert [label for _, label in val].count(0) == 4 and [label for _, label in val].count(1) == 2
    assert [label for _, label in train].count(2) == 1  # an identity keeps at least one training image
    assert split(seed=1)[1] != val


def test_no_val_fraction_means_no_validation(tmp_path):
    write_face_folder(tmp_path, {"a": 2})
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=1)
    assert dm.val_dataset is None and dm.val_dataloader() == []


def test_num_classes_is_checked(tmp_path):
    write_face_folder(tmp_path, {"a": 1, "b": 1})
    assert ImageFolderFaceDataModule(str(tmp_path), num_classes=2).num_classes == 2
    root = re.escape(str(tmp_path))
    with pytest.raises(ValueError, match=rf"`num_classes`=3 but '{root}' has 2 identity folders"):
        ImageFolderFaceDataModule(str(tmp_path), num_classes=3)


def test_missing_root_raises(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=rf"`root` '{re.escape(str(missing))}' does not exist"):
        ImageFolderFaceDataModule(str(missing))


def test_root_without_identity_folders_raises(tmp_path):
    (tmp_path / "loose.png").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"`root` '{re.escape(str(tmp_path))}' has no identity sub-folders"):
        ImageFolderFaceDataModule(str(tmp_path))


def test_identity_folder_without_images_raises(tmp_path):
    write_face_folder(tmp_path, {"a": 1})
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("")
    empty = re.escape(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=rf"identity folder '{empty}' has no image files"):
        ImageFolderFaceDataModule(str(tmp_path))


def test_corrupt_image_raises_naming_the_file(tmp_path):
    write_face_folder(tmp_path, {"a": 1})
    bad = tmp_path / "a" / "zz.jpg"
    bad.write_bytes(b"definitely not a jpeg")
    dm = ImageFolderFaceDataModule(str(tmp_path), image_size=16, batch_size=1)
    message = rf"cannot read image '{re.escape(str(bad))}': cannot identify image file"
    with pytest.raises(RuntimeError, match=message):
        dm.train_dataset[1]


def test_truncated_image_raises_naming_the_file(tmp_path):
    write_face_folder(tmp_path, {"a": 2})
    truncated = tmp_path / "a" / "001.png"
    truncated.write_bytes(truncated.read_bytes()[:100])
    dm = ImageFolderFaceDataModule(str(tmp_path), batch_size=1)
    with pytest.raises(RuntimeError, match=rf"cannot read image '{re.escape(str(truncated))}'"):
        dm.train_dataset[1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"val_fraction": 1.0}, ValueError, r"`val_fraction` must be a number ≥ 0 and < 1, got 1.0"),
        ({"val_fraction": "0.1"}, TypeError, r"`val_fraction` must be a number ≥ 0 and < 1, got '0.1' \(str\)"),
        ({"image_size": 0}, ValueError, r"`image_size` must be an integer ≥ 1, got 0"),
        ({"image_size": "112"}, TypeError, r"`image_size` must be an integer ≥ 1, got '112' \(str\)"),
        ({"num_classes": 0}, ValueError, r"`num_classes` must be an integer ≥ 1, got 0"),
        ({"num_classes": 2}, ValueError, r"`num_classes`=2 but '.*' has 1 identity folders"),
        ({"seed": -1}, ValueError, r"`seed` must be an integer ≥ 0, got -1"),
        ({"extensions": ".png"}, TypeError, r"`extensions` must be a list of file name endings .*got '\.png' \(str\)"),
        ({"extensions": []}, ValueError, r"`extensions` must be a non-empty list .*got \[\]"),
        ({"extensions": [".png", 3]}, TypeError, r"`extensions` must be a list of file name endings"),
        ({"root": "{tmp}/nowhere"}, FileNotFoundError, r"image folder `root` '.*nowhere' does not exist"),
        ({"root": 42}, TypeError, r"`root` must be a path, got 42 \(int\)"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"pin_memory": "off-ish"}, ValueError, r"`pin_memory` must be true or false, got 'off-ish'"),
    ],
)
def test_bad_arguments_raise(tmp_path, kwargs, error, match):
    write_face_folder(tmp_path, {"a": 1})
    arguments = {"root": str(tmp_path), **kwargs}
    if isinstance(arguments["root"], str):
        arguments["root"] = arguments["root"].format(tmp=tmp_path)
    with pytest.raises(error, match=match):
        ImageFolderFaceDataModule(**arguments)


def test_bad_dataset_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match=r"`image_size` must be an integer ≥ 1, got -4"):
        ImageFolderFaceDataset([], image_size=-4)


def test_hyperparameters_are_saved(tmp_path):
    write_face_folder(tmp_path, {"a": 1})
    dm = ImageFolderFaceDataModule(str(tmp_path), image_size=16, batch_size=1, augmentation={"hflip": 0.0})
    assert dm.hparams["root"] == str(tmp_path) and dm.hparams["image_size"] == 16
    assert ImageFolderFaceDataModule(**dm.hparams).num_classes == 1


def test_config_instantiates(tmp_path):
    write_face_folder(tmp_path, {"a": 2, "b": 2})
    cfg = OmegaConf.create({"seed": 0, "data": OmegaConf.load(CONF_DIR / "data" / "image_folder_face.yaml")})
    cfg.data.merge_with({"root": str(tmp_path), "num_classes": 2})
    cfg.data.merge_with({"num_workers": 0, "persistent_workers": False})
    dm = instantiate(cfg.data)
    assert isinstance(dm, ImageFolderFaceDataModule)
    assert (dm.num_classes, dm.image_size, dm.pin_memory) == (2, 112, True)
    assert dm.train_dataset[0][0].shape == (3, 112, 112)
    extensions = dm.hparams["extensions"]
    assert type(extensions) is list and extensions == [".jpg", ".jpeg", ".png", ".bmp"]  # not a ListConfig
    assert dm.hparams["augmentation"] == {"hflip": 0.5, "rotation_degrees": 0.0, "color_jitter": 0.0}
