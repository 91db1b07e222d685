import numpy as np
import pytest
import torch

from lightning_memopt.data import NormalsFolderDataModule
from lightning_memopt.data.normals_folder import IMAGE_MEAN, IMAGE_STD, NormalsFolderDataset, scan_normals_folder
from tests.helpers import unit_normals, write_normals_sample


def test_samples_hold_the_normalised_image_the_normals_and_the_mask(tmp_path):
    mask = np.ones((6, 8), dtype=bool)
    mask[0, :3] = False
    pixels = write_normals_sample(tmp_path, "a", mask=mask)
    sample = NormalsFolderDataset(scan_normals_folder(tmp_path))[0]
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    expected_image = (torch.from_numpy(pixels).permute(2, 0, 1) / 255.0 - mean) / std
    torch.testing.assert_close(sample["image"], expected_image)
    assert torch.equal(sample["mask"][0], torch.from_numpy(mask))
    expected_normals = torch.from_numpy(unit_normals(6, 8)).permute(2, 0, 1)
    torch.testing.assert_close(sample["normal"][:, 1:], expected_normals[:, 1:])
    assert torch.all(sample["normal"][:, 0, :3] == 0)


def test_without_a_mask_file_finite_nonzero_normals_are_valid(tmp_path):
    normals = unit_normals(6, 8)
    normals[1, 1] = np.nan
    normals[2, 2] = 0.0
    write_normals_sample(tmp_path, "a", normals=normals, extension=".jpg")
    (files,) = scan_normals_folder(tmp_path)
    assert files.mask is None and files.image.endswith("a.jpg")
    sample = NormalsFolderDataset([files])[0]
    assert sample["mask"].sum() == 6 * 8 - 2 and not sample["mask"][0, 1, 1] and not sample["mask"][0, 2, 2]
    assert torch.isfinite(sample["normal"]).all()


def test_near_unit_normals_are_accepted_and_renormalised(tmp_path):
    write_normals_sample(tmp_path, "a", normals=unit_normals(6, 8) * 1.005)
    sample = NormalsFolderDataset(scan_normals_folder(tmp_path), unit_tolerance=0.01)[0]
    torch.testing.assert_close(sample["normal"].norm(dim=0), torch.ones(6, 8))


def test_normals_off_unit_length_name_the_file_and_the_tolerance(tmp_path):
    normals = unit_normals(6, 8)
    normals[4, 5] *= 2.0
    write_normals_sample(tmp_path, "a", normals=normals)
    dataset = NormalsFolderDataset(scan_normals_folder(tmp_path), unit_tolerance=0.01)
    message = r"normals/a\.npy holds a normal of length 2 at pixel \(row 4, column 5\).*`unit_tolerance`=0\.01"
    with pytest.raises(ValueError, match=message):
        dataset[0]


def test_a_normal_map_of_the_wrong_shape_names_both_files_and_the_expected_shape(tmp_path):
    write_normals_sample(tmp_path, "x", size=(20, 24), normals=unit_normals(10, 12))
    dataset = NormalsFolderDataset(scan_normals_folder(tmp_path))
    message = r"normals/x\.npy has shape \(10, 12, 3\), expected \(H, W, 3\) = \(20, 24, 3\) to match .*images/x\.png"
    with pytest.raises(ValueError, match=message):
        dataset[0]


def test_bad_mask_dtype_and_corrupt_files_name_the_file(tmp_path):
    write_normals_sample(tmp_path, "a", mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match=r"masks/a\.png has shape \(3, 3\), expected \(H, W\) = \(6, 8\)"):
        NormalsFolderDataset(scan_normals_folder(tmp_path))[0]
    write_normals_sample(tmp_path / "int", "b", normals=np.ones((6, 8, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"normals/b\.npy has dtype int64, expected floating-point"):
        NormalsFolderDataset(scan_normals_folder(tmp_path / "int"))[0]
    write_normals_sample(tmp_path / "corrupt", "c")
    (tmp_path / "corrupt" / "normals" / "c.npy").write_bytes(b"not a numpy file")
    with pytest.raises(RuntimeError, match=r"cannot read normals .*normals/c\.npy"):
        NormalsFolderDataset(scan_normals_folder(tmp_path / "corrupt"))[0]


def test_missing_files_are_reported_when_scanning(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no `images` sub-folder"):
        scan_normals_folder(tmp_path)
    write_normals_sample(tmp_path, "a")
    (tmp_path / "normals" / "a.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"images/a\.png' has no normals file .*normals/a\.npy"):
        NormalsFolderDataModule(str(tmp_path))
    (tmp_path / "images" / "a.png").unlink()
    with pytest.raises(ValueError, match=r"has no image files"):
        scan_normals_folder(tmp_path)


def test_resizing_gives_one_size_withunit_normals(tmp_path):
    write_normals_sample(tmp_path, "a", size=(12, 16), seed=1)
    write_normals_sample(tmp_path, "b", size=(6, 8), seed=2)
    dm = NormalsFolderDataModule(str(tmp_path), image_size=(8, 6), batch_size=2, drop_last=False)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == batch["normal"].shape == (2, 3, 8, 6) and batch["mask"].shape == (2, 1, 8, 6)
    valid_norms = batch["normal"].norm(dim=1)[batch["mask"][:, 0]]
    torch.testing.assert_close(valid_norms, torch.ones_like(valid_norms))


def test_without_resizing_every_image_must_share_the_first_size(tmp_path):
    write_normals_sample(tmp_path, "a", size=(6, 8))
    write_normals_sample(tmp_path, "b", size=(8, 8))
    dataset = NormalsFolderDataset(scan_normals_folder(tmp_path))
    assert dataset[0]["image"].shape == (3, 6, 8)
    with pytest.raises(ValueError, match=r"images/b\.png is 8x8 \(H x W\) but .*images/a\.png is 6x8"):
        dataset[1]


def test_validation_fraction_splits_the_samples(tmp_path):
    for index in range(5):
        write_normals_sample(tmp_path, f"{index}", seed=index)
    dm = NormalsFolderDataModule(str(tmp_path), val_fraction=0.4, batch_size=1)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (3, 2)
    train_names = {files.image for files in dm.train_dataset.files}
    assert train_names.isdisjoint(files.image for files in dm.val_dataset.files)
    assert NormalsFolderDataModule(str(tmp_path)).val_dataset is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"val_fraction": 1.0}, ValueError, r"`val_fraction` must be a number ≥ 0 and < 1, got 1.0"),
        ({"unit_tolerance": 0.0}, ValueError, r"`unit_tolerance` must be a number > 0 and < 1, got 0.0"),
        ({"unit_tolerance": "1e-2"}, TypeError, r"`unit_tolerance` must be a number > 0 and < 1, got '1e-2' \(str\)"),
        ({"image_size": (8,)}, TypeError, r"`image_size` must be \(H, W\), two integers ≥ 1, got \(8,\)"),
        ({"image_size": (8, 0)}, ValueError, r"`image_size` must be \(H, W\), two integers ≥ 1, got \(8, 0\)"),
        ({"seed": "x"}, TypeError, r"`seed` must be an integer ≥ 0, got 'x' \(str\)"),
        ({"extensions": ".png"}, TypeError, r"`extensions` must be a list of file name endings"),
        ({"root": "{tmp}/nowhere"}, FileNotFoundError, r"normals folder `root` '.*nowhere' does not exist"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"drop_last": "nope"}, ValueError, r"`drop_last` must be true or false, got 'nope'"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, kwargs, error, message):
    write_normals_sample(tmp_path, "a")
    arguments = {"root": str(tmp_path), **kwargs}
    arguments["root"] = arguments["root"].format(tmp=tmp_path)
    with pytest.raises(error, match=message):
        NormalsFolderDataModule(**arguments)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"image_size": [4, 4.5]}, TypeError, r"`image_size` must be \(H, W\), two integers ≥ 1, got \[4, 4.5\]"),
        ({"unit_tolerance": 1.0}, ValueError, r"`unit_tolerance` must be a number > 0 and < 1, got 1.0"),
    ],
)
def test_bad_dataset_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        NormalsFolderDataset([], **kwargs)


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (lambda root: (root / "normals" / "a.npy").write_bytes(b""), RuntimeError, r"cannot read normals .*a\.npy"),
        (
            lambda root: (root / "normals" / "a.npy").write_bytes((root / "normals" / "a.npy").read_bytes()[:150]),
            RuntimeError,
            r"cannot read normals .*normals/a\.npy.*Failed to read all data",
        ),
        (
            lambda root: np.save(root / "normals" / "a.npy", unit_normals(6, 7)),
            ValueError,
            r"normals/a\.npy has shape \(6, 7, 3\), expected \(H, W, 3\) = \(6, 8, 3\) to match .*images/a\.png",
        ),
        (
            lambda root: (root / "images" / "a.png").write_bytes(b"not a png"),
            RuntimeError,
            r"cannot read image '.*images/a\.png'",
        ),
        (
            lambda root: (root / "images" / "a.png").write_bytes((root / "images" / "a.png").read_bytes()[:60]),
            RuntimeError,
            r"cannot read image '.*images/a\.png'",
        ),
        (
            lambda root: (root / "masks" / "a.png").write_bytes(b"\x89PNG broken"),
            RuntimeError,
            r"cannot read image '.*masks/a\.png'",
        ),
    ],
)
def test_unreadable_or_mismatched_files_name_the_file(tmp_path, damage, error, message):
    write_normals_sample(tmp_path, "a", mask=np.ones((6, 8), dtype=bool))
    damage(tmp_path)
    with pytest.raises(error, match=message):
        NormalsFolderDataset(scan_normals_folder(tmp_path))[0]
