import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from lightning_memopt.data import ImageFolderFaceDataModule, MemmapFaceDataModule, pack_image_folder
from lightning_memopt.data.memmap_face import MemmapFaceDataset
from tests.helpers import write_face_folder

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_face_folder(tmp_path / "faces", {"bob": 3, "alice": 4, "carol": 2}, size=(16, 16))


@pytest.fixture
def packed(folder, tmp_path) -> Path:
    pack_image_folder(folder, tmp_path / "packed")
    return tmp_path / "packed"


def all_samples(dataset):
    images, labels = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(images), torch.tensor(labels)


@pytest.mark.parametrize("val_fraction", [0.0, 0.5])
def test_matches_the_image_folder_pixel_exactly(folder, packed, val_fraction):
    memmap = MemmapFaceDataModule(str(packed), val_fraction=val_fraction, seed=3, batch_size=2)
    images = ImageFolderFaceDataModule(str(folder), val_fraction=val_fraction, seed=3, batch_size=2)
    assert memmap.num_classes == images.num_classes == 3
    pairs = [(memmap.train_dataset, images.train_dataset)]
    if val_fraction:
        pairs.append((memmap.val_dataset, images.val_dataset))
    else:
        assert memmap.val_dataset is None and memmap.val_dataloader() == []
    for from_memmap, from_folder in pairs:
        memmap_images, memmap_labels = all_samples(from_memmap)
        folder_images, folder_labels = all_samples(from_folder)
        assert torch.equal(memmap_images, folder_images)
        assert torch.equal(memmap_labels, folder_labels)


def test_batches_have_face_format(packed):
    dm = MemmapFaceDataModule(str(packed), batch_size=4, augmentation={"hflip": 0.5})
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.min() >= 0 and labels.max() < 3
    assert images.min() >= -1 and images.max() <= 1


def test_memmap_is_opened_lazily_and_never_pickled(packed):
    dm = MemmapFaceDataModule(str(packed), batch_size=2)
    dataset = dm.train_dataset
    assert dataset._images is None
    dataset[0]
    assert isinstance(dataset._images, np.memmap)
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._images is None
    assert torch.equal(clone[4][0], dataset[4][0])


def test_dataloader_with_two_workers(packed):
    dataset = MemmapFaceDataModule(str(packed), batch_size=2).train_dataset
    dataset[0]  # an open memmap in the parent process must not travel to the workers
    expected_images, expected_labels = all_samples(dataset)
    batches = list(DataLoader(dataset, batch_size=2, num_workers=2))
    assert torch.equal(torch.cat([images for images, _ in batches]), expected_images)
    assert torch.equal(torch.cat([labels for _, labels in batches]), expected_labels)


def test_datamodule_with_persistent_workers(packed):
    dm = MemmapFaceDataModule(str(packed), batch_size=3, num_workers=2, persistent_workers=True)
    labels = torch.cat([batch[1] for batch in dm.train_dataloader()])
    assert sorted(labels.tolist()) == [0] * 4 + [1] * 3 + [2] * 2


def test_num_classes_is_checked(packed):
    assert MemmapFaceDataModule(str(packed), num_classes=3).num_classes == 3
    meta = re.escape(str(packed / "meta.json"))
    with pytest.raises(ValueError, match=rf"`num_classes`=4 but '{meta}' says 3 identities"):
        MemmapFaceDataModule(str(packed), num_classes=4)


def test_image_size_is_checked(packed):
    assert MemmapFaceDataModule(str(packed)).image_size == 16
    assert MemmapFaceDataModule(str(packed), image_size=16).image_size == 16
    meta = re.escape(str(packed / "meta.json"))
    with pytest.raises(ValueError, match=rf"`image_size`=112 but '{meta}' describes 16x16 images"):
        MemmapFaceDataModule(str(packed), image_size=112)


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`path` '.*nowhere' does not exist"):
        MemmapFaceDataModule(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("name", ["images.u8", "labels.npy", "meta.json"])
def test_missing_file_raises_naming_it(packed, name):
    (packed / name).unlink()
    with pytest.raises(FileNotFoundError, match=rf"file '{re.escape(str(packed / name))}' is missing"):
        MemmapFaceDataModule(str(packed))


def test_truncated_images_raise_with_expected_and_actual_bytes(packed):
    images = packed / "images.u8"
    images.write_bytes(images.read_bytes()[:-5])
    expected = 9 * 16 * 16 * 3
    file = re.escape(str(images))
    message = rf"'{file}' has {expected - 5} bytes .* shape \(9, 16, 16, 3\) = {expected} bytes"
    with pytest.raises(ValueError, match=message):
        MemmapFaceDataModule(str(packed))


def test_wrong_number_of_labels_raises(packed):
    np.save(packed / "labels.npy", np.zeros(8, dtype=np.int64))
    with pytest.raises(ValueError, match=r"labels.npy' has 8 labels but meta.json says `count` 9"):
        MemmapFaceDataModule(str(packed))


def test_labels_out_of_range_raise(packed):
    np.save(packed / "labels.npy", np.array([0, 1, 2, 3, 0, 0, 0, 0, 0], dtype=np.int64))
    with pytest.raises(ValueError, match=r"labels.npy' has labels in \[0, 3\], outside \[0, 3\)"):
        MemmapFaceDataModule(str(packed))


def test_non_integer_labels_raise(packed):
    np.save(packed / "labels.npy", np.zeros(9, dtype=np.float32))
    with pytest.raises(ValueError, match=r"labels.npy' must hold a 1-D integer array, got float32"):
        MemmapFaceDataModule(str(packed))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "faces.v0"}, r"meta.json' has `format` 'faces.v0'; expected 'lightning_memopt.faces.v1'"),
        ({"height": None}, r"meta.json' misses keys \['height'\]"),
        ({"width": 0}, r"meta.json' has `width` 0; expected a positive integer"),
        ({"channels": 1}, r"meta.json' has `channels` 1; only 3 \(RGB\) is supported"),
    ],
)
def test_bad_meta_raises(packed, change, match):
    meta_file = packed / "meta.json"
    meta = json.loads(meta_file.read_text())
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        MemmapFaceDataModule(str(packed))


def test_meta_that_is_not_json_raises(packed):
    (packed / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read '.*meta.json' as JSON"):
        MemmapFaceDataModule(str(packed))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"val_fraction": -0.1}, ValueError, r"`val_fraction` must be a number ≥ 0 and < 1, got -0.1"),
        ({"val_fraction": None}, TypeError, r"`val_fraction` must be a number ≥ 0 and < 1, got None"),
        ({"num_classes": "3"}, TypeError, r"`num_classes` must be an integer ≥ 1, got '3' \(str\)"),
        ({"num_classes": 4}, ValueError, r"`num_classes`=4 but '.*meta\.json' says 3 identities"),
        ({"image_size": 0}, ValueError, r"`image_size` must be an integer ≥ 1, got 0"),
        ({"image_size": 32}, ValueError, r"`image_size`=32 but '.*meta\.json' describes 16x16 images"),
        ({"seed": 1.5}, TypeError, r"`seed` must be an integer ≥ 0, got 1.5 \(float\)"),
        ({"path": "{tmp}/nowhere"}, FileNotFoundError, r"memmap face dataset `path` '.*nowhere' does not exist"),
        ({"path": ["a", "b"]}, TypeError, r"`path` must be a path, got \['a', 'b'\] \(list\)"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"val_batch_size": -1}, ValueError, r"`val_batch_size` must be an integer ≥ 1, got -1"),
        ({"persistent_workers": "maybe"}, ValueError, r"`persistent_workers` must be true or false, got 'maybe'"),
    ],
)
def test_bad_arguments_raise(packed, tmp_path, kwargs, error, match):
    arguments = {"path": str(packed), **kwargs}
    if isinstance(arguments["path"], str):
        arguments["path"] = arguments["path"].format(tmp=tmp_path)
    with pytest.raises(error, match=match):
        MemmapFaceDataModule(**arguments)


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda file: file.write_bytes(b""), r"cannot read '.*labels\.npy' as a \.npy array"),
        (lambda file: file.write_bytes(file.read_bytes()[:100]), r"cannot read '.*labels\.npy' as a \.npy array"),
        (lambda file: file.write_text("0,1,2"), r"cannot read '.*labels\.npy' as a \.npy array"),
        (lambda file: np.save(file, np.zeros((9, 1), np.int64)), r"labels\.npy' must hold a 1-D integer array"),
    ],
)
def test_unreadable_labels_name_the_file(packed, write, match):
    write(packed / "labels.npy")
    with pytest.raises(ValueError, match=match):
        MemmapFaceDataModule(str(packed))


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ("[1, 2]", r"meta\.json' must hold a JSON object, got list"),
        ('{"format": "lightning_memopt.faces.v1"}', r"meta\.json' misses keys \['count', 'height', 'width'"),
        ("", r"cannot read '.*meta\.json' as JSON"),
    ],
)
def test_malformed_meta_names_the_file(packed, meta, match):
    (packed / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=match):
        MemmapFaceDataModule(str(packed))


def test_images_larger_than_meta_says_raise(packed):
    images = packed / "images.u8"
    images.write_bytes(images.read_bytes() + b"\0" * 3)
    with pytest.raises(ValueError, match=r"images\.u8' has 6915 bytes but meta\.json describes .* = 6912 bytes"):
        MemmapFaceDataModule(str(packed))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"images_file": "{tmp}/none.u8"}, FileNotFoundError, r"`images_file`: no file at '.*none\.u8'"),
        ({"shape": (2, 2)}, TypeError, r"`shape` must be \(count, height, width\), got \(2, 2\)"),
        ({"shape": (3, 2, 3)}, ValueError, r"images\.u8' has 36 bytes, not the 54 of `shape` \(3, 2, 3\)"),
        ({"labels": np.array([0.0, 1.0])}, ValueError, r"`labels` must be 2 integers \(one per image\)"),
        ({"indices": np.array([2])}, ValueError, r"`indices` must be a list of rows in \[0, 2\), got array\(\[2\]\)"),
    ],
)
def test_bad_dataset_arguments_raise(tmp_path, kwargs, error, match):
    np.zeros((2, 2, 3, 3), dtype=np.uint8).tofile(tmp_path / "images.u8")
    arguments = {"images_file": str(tmp_path / "images.u8"), "shape": (2, 2, 3), "labels": np.array([0, 1]), **kwargs}
    arguments["images_file"] = arguments["images_file"].format(tmp=tmp_path)
    with pytest.raises(error, match=match):
        MemmapFaceDataset(**arguments)


def test_dataset_on_hand_written_file(tmp_path):
    pixels = np.arange(2 * 2 * 3 * 3, dtype=np.uint8).reshape(2, 2, 3, 3)
    pixels.tofile(tmp_path / "images.u8")
    labels, indices = np.array([1, 0]), np.array([1])
    dataset = MemmapFaceDataset(str(tmp_path / "images.u8"), (2, 2, 3), labels, indices=indices)
    image, label = dataset[0]
    assert len(dataset) == 1 and label == 0
    expected = (torch.from_numpy(pixels[1]).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(image, expected)


def test_config_instantiates(packed):
    cfg = OmegaConf.create({"seed": 0, "data": OmegaConf.load(CONF_DIR / "data" / "memmap_face.yaml")})
    cfg.data.merge_with({"path": str(packed), "num_classes": 3, "image_size": 16})
    cfg.data.merge_with({"num_workers": 0, "persistent_workers": False})
    dm = instantiate(cfg.data)
    assert isinstance(dm, MemmapFaceDataModule)
    assert (dm.num_classes, dm.batch_size, dm.pin_memory) == (3, 128, True)
    assert dm.hparams["path"] == str(packed)
