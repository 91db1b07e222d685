import pytest
import torch

from lightning_memopt.data import FaceAugmentation


@pytest.fixture
def image() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(3, 12, 20, generator=generator) * 2 - 1


def test_all_off_is_identity(image):
    augment = FaceAugmentation(hflip=0.0, rotation_degrees=0.0, color_jitter=0.0)
    assert augment.is_identity
    for _ in range(5):
        assert torch.equal(augment(image), image)


def test_default_is_not_identity():
    assert not FaceAugmentation().is_identity
    assert not FaceAugmentation(hflip=0.0, color_jitter=0.1).is_identity


def test_hflip_one_is_exact_flip(image):
    augment = FaceAugmentation(hflip=1.0)
    assert torch.equal(augment(image), image.flip(-1))


def test_hflip_probability_flips_about_half_the_time(image):
    torch.manual_seed(0)
    augment = FaceAugmentation(hflip=0.5)
    flips = sum(torch.equal(augment(image), image.flip(-1)) for _ in range(400))
    assert 150 < flips < 250


def test_same_global_seed_same_result(image):
    augment = FaceAugmentation(hflip=0.5, rotation_degrees=20.0, color_jitter=0.3)
    torch.manual_seed(7)
    first = [augment(image) for _ in range(3)]
    torch.manual_seed(7)
    second = [augment(image) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])


def test_rotation_changes_image_keeps_shape_and_range(image):
    torch.manual_seed(0)
    rotated = FaceAugmentation(hflip=0.0, rotation_degrees=30.0)(image)
    assert rotated.shape == image.shape
    assert not torch.allclose(rotated, image)
    assert rotated.min() >= -1 and rotated.max() <= 1


def test_rotation_by_90_degrees_is_rot90(monkeypatch):
    square = torch.rand(3, 9, 9) * 2 - 1
    monkeypatch.setattr("lightning_memopt.data.augment._uniform", lambda low, high, generator: high)
    rotated = FaceAugmentation(hflip=0.0, rotation_degrees=90.0)(square)
    matches = [torch.allclose(rotated, square.rot90(k, dims=(1, 2)), atol=1e-5) for k in (1, -1)]
    assert any(matches)


def test_rotation_by_180_degrees_of_non_square_image_flips_both_axes(image, monkeypatch):
    monkeypatch.setattr("lightning_memopt.data.augment._uniform", lambda low, high, generator: high)
    rotated = FaceAugmentation(hflip=0.0, rotation_degrees=180.0)(image)
    torch.testing.assert_close(rotated, image.flip(1, 2), atol=1e-5, rtol=0)


def test_rotation_by_zero_angle_is_identity(image, monkeypatch):
    monkeypatch.setattr("lightning_memopt.data.augment._uniform", lambda low, high, generator: 0.0)
    rotated = FaceAugmentation(hflip=0.0, rotation_degrees=45.0)(image)
    torch.testing.assert_close(rotated, image, atol=1e-5, rtol=0)


def test_color_jitter_changes_image_and_keeps_range():
    torch.manual_seed(0)
    augment = FaceAugmentation(hflip=0.0, color_jitter=0.9)
    for _ in range(20):
        image = torch.rand(3, 8, 8) * 2 - 1
        jittered = augment(image)
        assert jittered.shape == image.shape
        assert jittered.min() >= -1 and jittered.max() <= 1
        assert not torch.allclose(jittered, image)


def test_color_jitter_with_unit_factors_is_identity(image, monkeypatch):
    monkeypatch.setattr("lightning_memopt.data.augment._uniform", lambda low, high, generator: 1.0)
    jittered = FaceAugmentation(hflip=0.0, color_jitter=0.5)(image)
    torch.testing.assert_close(jittered, image, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hflip": -0.1}, ValueError, r"`hflip` must be a number ≥ 0 and ≤ 1, got -0.1"),
        ({"hflip": 1.5}, ValueError, r"`hflip`.*got 1.5"),
        ({"hflip": float("nan")}, ValueError, r"`hflip`.*got nan"),
        ({"hflip": "half"}, TypeError, r"`hflip` must be a number ≥ 0 and ≤ 1, got 'half' \(str\)"),
        ({"hflip": True}, TypeError, r"`hflip`.*got True \(bool\)"),
        ({"rotation_degrees": -1.0}, ValueError, r"`rotation_degrees` must be a number ≥ 0 and ≤ 180, got -1.0"),
        ({"rotation_degrees": 181}, ValueError, r"`rotation_degrees`.*got 181"),
        ({"rotation_degrees": None}, TypeError, r"`rotation_degrees`.*got None"),
        ({"color_jitter": 1.0}, ValueError, r"`color_jitter` must be a number ≥ 0 and < 1, got 1.0"),
        ({"color_jitter": -0.5}, ValueError, r"`color_jitter`.*got -0.5"),
        ({"color_jitter": "0.2"}, TypeError, r"`color_jitter`.*got '0.2' \(str\)"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        FaceAugmentation(**kwargs)


def test_rejects_non_chw_rgb_input():
    message = r"`image` must be a CHW tensor with 3 channels, got shape \(2, 3, 8, 8\)"
    with pytest.raises(ValueError, match=message):
        FaceAugmentation()(torch.zeros(2, 3, 8, 8))


def test_to_dict_repr_and_equality():
    augment = FaceAugmentation(hflip=0.25, rotation_degrees=10, color_jitter=0.2)
    assert augment.to_dict() == {"hflip": 0.25, "rotation_degrees": 10.0, "color_jitter": 0.2}
    assert FaceAugmentation(**augment.to_dict()) == augment
    assert repr(augment) == "FaceAugmentation(hflip=0.25, rotation_degrees=10.0, color_jitter=0.2)"
