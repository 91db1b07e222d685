import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_memopt.data import SyntheticTrackingDataModule
from lightning_memopt.data.moving_layers import Layer, place_points, point_visibility, random_layers, render_layers
from lightning_memopt.data.synthetic_tracking import SyntheticTrackingDataset


def _dataset(**kwargs):
    options = dict(num_clips=4, sequence_len=8, image_size=(64, 64), traj_per_sample=16, seed=0)
    options.update(kwargs)
    return SyntheticTrackingDataset(**options)


def test_clips_are_deterministic_per_seed_and_index():
    first, again, other_seed = _dataset()[2], _dataset()[2], _dataset(seed=1)[2]
    for key in first:
        assert torch.equal(first[key], again[key])
    assert not torch.equal(first["video"], other_seed["video"])
    assert not torch.equal(first["video"], _dataset()[3]["video"])


def test_sample_format():
    sample = _dataset(image_size=(48, 64))[0]
    assert sample["video"].shape == (8, 3, 48, 64) and sample["video"].dtype == torch.float32
    assert sample["video"].min() >= 0 and sample["video"].max() <= 255
    assert sample["tracks"].shape == (8, 16, 2) and sample["visibility"].shape == (8, 16)
    assert sample["queries"].shape == (16, 3)
    frames = sample["queries"][:, 0].long()
    assert sample["visibility"][frames, torch.arange(16)].all()
    torch.testing.assert_close(sample["queries"][:, 1:], sample["tracks"][frames, torch.arange(16)])


def test_clips_hold_occlusions_and_motion():
    visibility = torch.stack([_dataset()[i]["visibility"] for i in range(4)])
    tracks = torch.stack([_dataset()[i]["tracks"] for i in range(4)])
    assert 0.5 < visibility.float().mean() < 1.0  # some points get hidden or leave the frame
    assert (tracks[:, -1] - tracks[:, 0]).norm(dim=-1).max() > 5.0  # points move


def test_a_shape_is_drawn_where_its_track_says():
    still = torch.full((3, 2), 31.5)
    background = Layer(still, torch.tensor([40.0, 40.0]), ellipse=False, texture=torch.zeros(3, 2, 2))
    moving = torch.tensor([[10.0, 20.0], [15.0, 20.0], [20.0, 20.0]])  # 5 px per frame to the right
    square = Layer(moving, torch.tensor([3.0, 3.0]), ellipse=False, texture=torch.full((3, 2, 2), 255.0))
    video = render_layers([background, square], 64, 64)
    for t, (x, y) in enumerate(moving.long().tolist()):
        assert video[t, :, y, x].tolist() == [255.0] * 3  # the centre
        assert video[t, :, y, x + 4].tolist() == [0.0] * 3  # just right of the square


def test_points_behind_a_nearer_layer_or_outside_the_frame_are_hidden():
    still = torch.full((2, 2), 8.0)
    background = Layer(still, torch.tensor([10.0, 10.0]), ellipse=False, texture=torch.zeros(3, 2, 2))
    disc_path = torch.tensor([[8.0, 8.0], [14.0, 8.0]])
    disc = Layer(disc_path, torch.tensor([2.0, 2.0]), ellipse=True, texture=torch.zeros(3, 2, 2))
    # a background point under the disc in frame 0, free in frame 1; a disc point; a point leaving the frame
    tracks = torch.tensor([[[8.0, 8.0], [9.0, 8.0], [15.0, 3.0]], [[8.0, 8.0], [15.0, 8.0], [16.0, 3.0]]])
    visibility = point_visibility(tracks, torch.tensor([0, 1, 0]), [background, disc], 16, 16)
    assert visibility.tolist() == [[False, True, True], [True, True, False]]


def test_placed_points_ride_on_their_layer():
    rng = np.random.default_rng(0)
    layers = random_layers(rng, num_frames=5, height=32, width=32, num_objects=2)
    tracks, owners = place_points(rng, layers, 30, 32, 32)
    for n, owner in enumerate(owners.tolist()):
        offset = tracks[:, n] - layers[owner].centres
        torch.testing.assert_close(offset, offset[:1].expand_as(offset))


def test_rendered_colour_follows_a_tracked_object_point():
    rng = np.random.default_rng(3)
    layers = random_layers(rng, num_frames=6, height=64, width=64, num_objects=1)
    video = render_layers(layers, 64, 64)
    tracks, owners = place_points(rng, layers, 64, 64, 64)
    visible = point_visibility(tracks, owners, layers, 64, 64)
    on_object = torch.nonzero((owners == 1) & visible.all(dim=0))[:, 0]
    assert len(on_object) > 0

    def colours(points):  # [T, P, 2] pixels -> [T, 3, P], bilinear
        return F.grid_sample(video, (points / 31.5 - 1.0)[:, :, None], align_corners=True)[..., 0]

    along_track = colours(tracks[:, on_object])
    standing_still = colours(tracks[:1, on_object].expand(6, -1, -1))
    assert (along_track - along_track[:1]).abs().mean() < 5.0  # of 255: only resampling differences
    assert (standing_still - standing_still[:1]).abs().mean() > 15.0  # the texture moved on


def test_datamodule_batches_and_validation_clips_differ():
    dm = SyntheticTrackingDataModule(
        num_clips=4, val_clips=2, sequence_len=6, image_size=(32, 48), traj_per_sample=5, batch_size=2
    )
    batch = next(iter(dm.train_dataloader()))
    assert batch["video"].shape == (2, 6, 3, 32, 48) and batch["tracks"].shape == (2, 6, 5, 2)
    assert batch["visibility"].dtype == torch.bool and batch["queries"].shape == (2, 5, 3)
    assert len(dm.val_dataset) == 2
    assert not torch.equal(dm.val_dataset[0]["video"], dm.train_dataset[0]["video"])
    assert SyntheticTrackingDataModule(val_clips=0).val_dataloader() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_clips": 0}, ValueError, r"`num_clips` must be an integer ≥ 1, got 0"),
        ({"val_clips": "none"}, TypeError, r"`val_clips` must be an integer ≥ 0, got 'none' \(str\)"),
        ({"sequence_len": 1}, ValueError, r"`sequence_len` must be an integer ≥ 2, got 1"),
        ({"sequence_len": 24.5}, TypeError, r"`sequence_len` must be an integer ≥ 2, got 24.5 \(float\)"),
        ({"traj_per_sample": 0}, ValueError, r"`traj_per_sample` must be an integer ≥ 1, got 0"),
        ({"num_objects": -1}, ValueError, r"`num_objects` must be an integer ≥ 0, got -1"),
        ({"seed": -3}, ValueError, r"`seed` must be an integer ≥ 0, got -3"),
        ({"image_size": (8, 64)}, ValueError, r"`image_size` must be \(H, W\), two integers ≥ 16, got \(8, 64\)"),
        ({"image_size": "384x512"}, TypeError, r"`image_size` must be \(H, W\).*got '384x512' \(str\)"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an integer ≥ 1, got 0"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"drop_last": "sure"}, ValueError, r"`drop_last` must be true or false, got 'sure'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SyntheticTrackingDataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_clips": -1}, ValueError, r"`num_clips` must be an integer ≥ 0, got -1"),
        ({"sequence_len": 0}, ValueError, r"`sequence_len` must be an integer ≥ 1, got 0"),
        ({"image_size": (1, 8)}, ValueError, r"`image_size` must be \(H, W\), two integers ≥ 2, got \(1, 8\)"),
        ({"traj_per_sample": "16"}, TypeError, r"`traj_per_sample` must be an integer ≥ 1, got '16' \(str\)"),
        ({"seed": -1}, ValueError, r"`seed` must be an integer ≥ 0, got -1"),
        ({"first_clip": -1}, ValueError, r"`first_clip` must be an integer ≥ 0, got -1"),
    ],
)
def test_bad_dataset_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        _dataset(**kwargs)


def test_samples_name_their_clip_and_batch_with_the_checking_collate():
    dm = SyntheticTrackingDataModule(num_clips=2, val_clips=1, sequence_len=4, image_size=(32, 32),
                                     traj_per_sample=3, batch_size=2)  # fmt: skip
    assert dm.val_dataset[0].source == "synthetic clip 2"  # validation clips follow the training ones
    batch = next(iter(dm.train_dataloader()))
    assert type(batch) is dict and batch["video"].shape == (2, 4, 3, 32, 32)


def test_index_out_of_range():
    with pytest.raises(IndexError, match="index 4 out of range for a dataset of 4 clips"):
        _dataset()[4]
