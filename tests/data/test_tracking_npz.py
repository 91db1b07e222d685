import numpy as np
import pytest
import torch

from lightning_memopt.data import TrackingNpzDataModule
from lightning_memopt.data.tracking_npz import TrackingNpzDataset, read_tracking_clip, write_tracking_clip


def _clip(frames=6, tracks=5, size=(16, 20), seed=0):
    rng = np.random.default_rng(seed)
    video = rng.integers(0, 256, size=(frames, *size, 3), dtype=np.uint8)
    positions = rng.uniform(0, min(size) - 1, size=(frames, tracks, 2))
    visibility = rng.random((frames, tracks)) < 0.8
    visibility[0] = True
    return video, positions, visibility


def _write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_round_trip_and_sample_format(tmp_path):
    video, tracks, visibility = _clip()
    write_tracking_clip(tmp_path / "clip.npz", video, tracks, visibility)
    read_video, read_tracks, read_visibility = read_tracking_clip(tmp_path / "clip.npz")
    assert np.array_equal(read_video, video) and np.array_equal(read_visibility, visibility)
    assert read_tracks.dtype == np.float32
    sample = TrackingNpzDataset([str(tmp_path / "clip.npz")], traj_per_sample=4, sequence_len=None, seed=0)[0]
    assert sample["video"].shape == (6, 3, 16, 20) and sample["video"].dtype == torch.float32
    assert sample["video"].max() <= 255 and sample["tracks"].shape == (6, 4, 2)
    # video channels come out as RGB planes
    torch.testing.assert_close(sample["video"][2, :, 3, 7], torch.from_numpy(video[2, 3, 7]).float())


def test_sequence_len_crops_frames(tmp_path):
    video, tracks, visibility = _clip(frames=10)
    write_tracking_clip(tmp_path / "clip.npz", video, tracks, visibility)
    sample = TrackingNpzDataset([str(tmp_path / "clip.npz")], traj_per_sample=3, sequence_len=4, seed=1)[0]
    assert sample["video"].shape[0] == 4 and sample["tracks"].shape == (4, 3, 2)
    starts = [
        t for t in range(7) if torch.equal(sample["video"][0], torch.from_numpy(video[t]).permute(2, 0, 1).float())
    ]
    assert len(starts) == 1


def test_fewer_visible_tracks_than_traj_per_sample_are_repeated(tmp_path):
    video, tracks, _ = _clip(tracks=4)
    visibility = np.zeros((6, 4), dtype=bool)
    visibility[:, [1, 3]] = True  # only two tracks are ever visible
    write_tracking_clip(tmp_path / "clip.npz", video, tracks, visibility)
    sample = TrackingNpzDataset([str(tmp_path / "clip.npz")], traj_per_sample=5, sequence_len=None, seed=0)[0]
    assert sample["tracks"].shape == (6, 5, 2) and sample["visibility"].all()
    chosen = {tuple(sample["tracks"][0, n].tolist()) for n in range(5)}
    assert chosen == {tuple(tracks[0, 1].astype(np.float32).tolist()), tuple(tracks[0, 3].astype(np.float32).tolist())}


def test_a_clip_without_visible_tracks_names_the_file(tmp_path):
    video, tracks, _ = _clip()
    file = str(tmp_path / "dark.npz")
    write_tracking_clip(file, video, tracks, np.zeros((6, 5), dtype=bool))
    with pytest.raises(ValueError, match=r"dark\.npz', frames 0…5: none of the 5 tracks is visible"):
        TrackingNpzDataset([file], traj_per_sample=2, sequence_len=None, seed=0)[0]


def test_a_clip_shorter_than_sequence_len_names_the_file(tmp_path):
    file = str(tmp_path / "short.npz")
    write_tracking_clip(file, *_clip(frames=3))
    with pytest.raises(ValueError, match=r"short\.npz' has 3 frames, fewer than `sequence_len`=4"):
        TrackingNpzDataset([file], traj_per_sample=2, sequence_len=4, seed=0)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"video": None}, r"misses the arrays \['video'\]; a tracking clip holds `video` uint8 T×H×W×3"),
        ({"video": np.zeros((6, 16, 20, 3), np.float32)}, r"`video` must be uint8 T×H×W×3, got float32"),
        (
            {"video": np.zeros((6, 16, 20), np.uint8)},
            r"`video` must be uint8 T×H×W×3, got uint8 of shape \(6, 16, 20\)",
        ),
        ({"tracks": np.zeros((5, 5, 2))}, r"`tracks` must be float T×N×2 with T = 6 .* shape \(5, 5, 2\)"),
        ({"tracks": np.zeros((6, 5, 3))}, r"`tracks` must be float T×N×2"),
        ({"tracks": np.zeros((6, 5, 2), np.int64)}, r"`tracks` must be float T×N×2 .* got int64"),
        ({"tracks": np.full((6, 5, 2), np.nan)}, r"`tracks` holds NaN or infinite positions"),
        ({"visibility": np.ones((6, 4), bool)}, r"`visibility` must be bool T×N = \(6, 5\) .* shape \(6, 4\)"),
        ({"visibility": np.ones((6, 5), np.float32)}, r"`visibility` must be bool T×N .* got float32"),
    ],
)
def test_bad_clips_name_the_file_and_the_expected_shapes(tmp_path, change, message):
    arrays = dict(zip(("video", "tracks", "visibility"), _clip(), strict=True))
    arrays.update(change)
    file = _write(tmp_path / "bad.npz", **{key: value for key, value in arrays.items() if value is not None})
    with pytest.raises(ValueError, match=r"bad\.npz'.*" + message):
        read_tracking_clip(file)


def test_integer_visibility_is_accepted(tmp_path):
    video, tracks, visibility = _clip()
    file = _write(tmp_path / "ints.npz", video=video, tracks=tracks, visibility=visibility.astype(np.uint8))
    assert read_tracking_clip(file)[2].dtype == bool


def test_unreadable_and_missing_files(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match=r"cannot read '.*junk\.npz' as a \.npz archive"):
        read_tracking_clip(tmp_path / "junk.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"single\.npy' holds a single array, not a \.npz archive"):
        read_tracking_clip(tmp_path / "single.npy")
    with pytest.raises(FileNotFoundError, match=r"tracking clip '.*absent\.npz' does not exist"):
        read_tracking_clip(tmp_path / "absent.npz")


def test_datamodule_splits_clips_and_batches(tmp_path):
    for index in range(5):
        write_tracking_clip(tmp_path / f"clip{index}.npz", *_clip(frames=8, seed=index))
    dm = TrackingNpzDataModule(str(tmp_path), traj_per_sample=3, sequence_len=6, val_fraction=0.4, batch_size=2)
    assert len(dm.train_dataset) == 3 and len(dm.val_dataset) == 2
    assert not set(dm.train_dataset.files) & set(dm.val_dataset.files)
    batch = next(iter(dm.train_dataloader()))
    assert batch["video"].shape == (2, 6, 3, 16, 20) and batch["queries"].shape == (2, 3, 3)
    assert TrackingNpzDataModule(str(tmp_path), batch_size=1).val_dataloader() == []


def test_datamodule_refuses_a_missing_or_empty_root(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`root` '.*nowhere' does not exist or is not a directory"):
        TrackingNpzDataModule(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"holds no \.npz clip; each holds `video` uint8 T×H×W×3"):
        TrackingNpzDataModule(str(tmp_path))
    with pytest.raises(ValueError, match=r"`traj_per_sample` must be at least 1, got 0"):
        TrackingNpzDataModule(str(tmp_path), traj_per_sample=0)
