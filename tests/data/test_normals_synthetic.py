import math

import numpy as np
import pytest
import torch

from lightning_memopt.data import LoaderDataModule, SyntheticNormalsDataModule
from lightning_memopt.data.normals_folder import IMAGE_MEAN, IMAGE_STD
from lightning_memopt.data.raycast import box, disc, pixel_coordinates, random_rotation, shade, sphere
from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataset, render_scene


def test_sphere_normals_are_the_analytic_unit_radius_vectors():
    x, y = pixel_coordinates(32, 24)
    center, radius = (0.1, -0.2, 0.3), 0.5
    surface = sphere(x, y, center, radius)
    px, py = x[surface.hit], y[surface.hit]
    pz = center[2] + np.sqrt(radius**2 - (px - center[0]) ** 2 - (py - center[1]) ** 2)
    expected = np.stack([px - center[0], py - center[1], pz - center[2]]) / radius
    np.testing.assert_allclose(surface.normal[:, surface.hit], expected, atol=1e-12)
    np.testing.assert_allclose(surface.depth[surface.hit], pz)
    np.testing.assert_allclose(np.linalg.norm(surface.normal[:, surface.hit], axis=0), 1.0)
    assert surface.hit.sum() == pytest.approx(math.pi * radius**2 / (2 / 32) ** 2, rel=0.1)


def test_disc_is_a_flat_patch_with_one_normal_within_its_radius():
    x, y = pixel_coordinates(40, 40)
    normal = (0.6, 0.0, 0.8)
    surface = disc(x, y, center=(0.0, 0.0, 0.0), normal=normal, radius=0.5)
    np.testing.assert_allclose(surface.normal[:, surface.hit].T, np.tile(normal, (int(surface.hit.sum()), 1)))
    # on the plane 0.6 x + 0.8 z = 0, so z = -0.75 x, and |p| < 0.5 is the projected ellipse
    np.testing.assert_allclose(surface.depth, -0.75 * x)
    assert np.array_equal(surface.hit, x**2 * (1 + 0.75**2) + y**2 < 0.25)


def test_box_normals_are_the_camera_facing_columns_of_its_rotation():
    x, y = pixel_coordinates(48, 48)
    rotation = random_rotation(np.random.default_rng(3))
    surface = box(x, y, center=(0.0, 0.0, 0.0), half_size=(0.4, 0.3, 0.2), rotation=rotation)
    seen = np.unique(np.round(surface.normal[:, surface.hit].T, 9), axis=0)
    assert 1 <= len(seen) <= 3  # piecewise constant: at most three faces are visible
    for normal in seen:
        matches = [np.allclose(normal, sign * rotation[:, k]) for k in range(3) for sign in (1, -1)]
        assert any(matches) and normal[2] > 0


def test_an_axis_aligned_box_shows_its_front_face_at_its_front_depth():
    x, y = pixel_coordinates(8, 8)
    surface = box(x, y, center=(0.0, 0.0, -0.5), half_size=(0.5, 0.5, 0.25), rotation=np.eye(3))
    assert np.array_equal(surface.hit, (np.abs(x) < 0.5) & (np.abs(y) < 0.5))
    np.testing.assert_allclose(surface.depth[surface.hit], -0.25)
    np.testing.assert_allclose(surface.normal[:, surface.hit].T, np.tile([0.0, 0.0, 1.0], (int(surface.hit.sum()), 1)))


def test_scenes_have_unit_camera_facing_normals_inside_the_mask_and_zero_outside():
    full_masks = partial_masks = 0
    for index in range(12):
        image, normal, mask = render_scene(np.random.default_rng([0, index]), 32, 24)
        assert image.shape == normal.shape == (3, 32, 24) and mask.shape == (32, 24)
        assert image.dtype == normal.dtype == torch.float32 and mask.dtype == torch.bool
        assert image.min() >= 0.0 and image.max() <= 1.0
        torch.testing.assert_close(normal.norm(dim=0)[mask], torch.ones(int(mask.sum())))
        assert torch.all(normal[2][mask] > 0) and torch.all(normal[:, ~mask] == 0)
        full_masks += bool(mask.all())
        partial_masks += bool(0 < mask.sum() < mask.numel())
    assert full_masks > 0 and partial_masks > 0  # scenes without a background plane leave invalid pixels


def test_lambertian_shading_carries_the_normal_into_the_image():
    light = np.array([0.0, 0.6, 0.8])
    normal = np.stack([np.zeros(3), np.array([0.0, 0.0, 1.0]), np.array([0.0, -0.8, 0.6]), np.array([0.0, -1.0, 0.0])])
    albedo = np.full((3, 1, 4), 0.5)
    shaded = shade(normal.T.reshape(3, 1, 4), albedo, light)
    # n·l = 0 (no normal), 0.8, 0 (perpendicular), -0.6 (facing away): ambient 0.3 plus 0.7·max(0, n·l)
    np.testing.assert_allclose(shaded[0, 0], 0.5 * np.array([0.3, 0.3 + 0.7 * 0.8, 0.3, 0.3]))


def test_samples_are_deterministic_per_seed_and_index():
    dataset = SyntheticNormalsDataset(4, (32, 24), seed=5)
    first, again = dataset[1], SyntheticNormalsDataset(4, (32, 24), seed=5)[1]
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(dataset[1]["normal"], dataset[2]["normal"])
    assert not torch.equal(first["normal"], SyntheticNormalsDataset(4, (32, 24), seed=6)[1]["normal"])
    shifted = SyntheticNormalsDataset(2, (32, 24), seed=5, first_index=1)
    assert torch.equal(shifted[0]["image"], first["image"])
    with pytest.raises(IndexError, match="index 4 out of range for a dataset of 4 samples"):
        dataset[4]


def test_samples_are_normalised_images_and_masked_unit_normals():
    sample = SyntheticNormalsDataset(1, (32, 24), seed=0)[0]
    assert set(sample) == {"image", "normal", "mask"}
    assert sample["mask"].shape == (1, 32, 24)
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    rgb = sample["image"] * std + mean
    assert rgb.min() >= -1e-5 and rgb.max() <= 1 + 1e-5


def test_datamodule_batches_and_separate_validation_scenes():
    dm = SyntheticNormalsDataModule(num_samples=4, val_samples=2, image_size=(32, 24), batch_size=2, seed=1)
    assert isinstance(dm, LoaderDataModule)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == batch["normal"].shape == (2, 3, 32, 24) and batch["mask"].shape == (2, 1, 32, 24)
    val = [sample["image"] for sample in dm.val_dataset]
    train = [sample["image"] for sample in dm.train_dataset]
    assert len(val) == 2 and not any(torch.equal(v, t) for v in val for t in train)
    assert dm.hparams["num_samples"] == 4 and dm.hparams["batch_size"] == 2
    assert SyntheticNormalsDataModule(num_samples=1, val_samples=0, image_size=(16, 16)).val_dataloader() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_samples": 0}, ValueError, r"`num_samples` must be an integer ≥ 1, got 0"),
        ({"num_samples": "many"}, TypeError, r"`num_samples` must be an integer ≥ 1, got 'many' \(str\)"),
        ({"val_samples": -1}, ValueError, r"`val_samples` must be an integer ≥ 0, got -1"),
        ({"image_size": (4, 16)}, ValueError, r"`image_size` must be \(H, W\), two integers ≥ 8, got \(4, 16\)"),
        ({"image_size": 64}, TypeError, r"`image_size` must be \(H, W\), two integers ≥ 8, got 64 \(int\)"),
        ({"image_size": "64x48"}, TypeError, r"`image_size` must be \(H, W\).*got '64x48' \(str\)"),
        ({"image_size": (64, 48, 3)}, TypeError, r"`image_size` must be \(H, W\).*got \(64, 48, 3\)"),
        ({"image_size": [64, "48"]}, TypeError, r"`image_size` must be \(H, W\).*got \[64, '48'\]"),
        ({"max_objects": 0}, ValueError, r"`max_objects` must be an integer ≥ 1, got 0"),
        ({"seed": -1}, ValueError, r"`seed` must be an integer ≥ 0, got -1"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an integer ≥ 1, got 0"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"num_workers": "2"}, TypeError, r"`num_workers` must be an integer ≥ 0, got '2' \(str\)"),
        ({"pin_memory": "perhaps"}, ValueError, r"`pin_memory` must be true or false, got 'perhaps'"),
        ({"persistent_workers": True}, ValueError, r"`persistent_workers=True` needs worker processes"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SyntheticNormalsDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_samples": -1}, ValueError, r"`num_samples` must be an integer ≥ 0, got -1"),
        ({"image_size": (0, 8)}, ValueError, r"`image_size` must be \(H, W\), two integers ≥ 1, got \(0, 8\)"),
        ({"seed": "1"}, TypeError, r"`seed` must be an integer ≥ 0, got '1' \(str\)"),
        ({"first_index": -2}, ValueError, r"`first_index` must be an integer ≥ 0, got -2"),
        ({"max_objects": 0}, ValueError, r"`max_objects` must be an integer ≥ 1, got 0"),
    ],
)
def test_bad_dataset_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SyntheticNormalsDataset(**{"num_samples": 2, "image_size": (8, 8), "seed": 0, **kwargs})


def test_drop_last_refuses_a_training_set_smaller_than_a_batch():
    dm = SyntheticNormalsDataModule(num_samples=2, image_size=(16, 16), batch_size=4)
    with pytest.raises(ValueError, match=r"the training set has 2 samples, fewer than `batch_size`=4"):
        dm.train_dataloader()
