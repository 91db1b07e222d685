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
        ({"tracks": np.full((6, 5, 2), np.nan)}, r"`tracks` holds 30 positions that are NaN or infinite"),
        ({"visibility": np.ones((6, 4), bool)}, r"`visibility` must be bool T×N = \(6, 5\) .* shape \(6, 4\)"),
        ({"visibility": np.full((6, 5), "1")}, r"`visibility` must be bool T×N .* got <U1"),
    ],
)
def test_bad_clips_name_the_file_and_the_expected_shapes(tmp_path, change, message):
    arrays = dict(zip(("video", "tracks", "visibility"), _clip(), strict=True))
    arrays.update(change)
    file = _write(tmp_path / "bad.npz", **{key: value for key, value in arrays.items() if value is not None})
    with pytest.raises(ValueError, match=r"bad\.npz'.*" + message):
        read_tracking_clip(file)


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.float32])
def test_integer_and_float_visibility_of_zeros_and_ones_is_accepted(tmp_path, dtype):
    video, tracks, visibility = _clip()
    file = _write(tmp_path / "flags.npz", video=video, tracks=tracks, visibility=visibility.astype(dtype))
    read = read_tracking_clip(file)[2]
    assert read.dtype == bool and np.array_equal(read, visibility)


def _changed(frame, point, value, base=None):
    """A copy of ``base`` (the tracks or the visibility of `_clip()`) with one entry set."""
    array = (_clip()[1] if base is None else base).copy()
    array[frame, point] = value
    return array


# `_clip()`: 6 frames of H×W = 16×20, 5 points; visible points may lie in x ∈ [-1, 20], y ∈ [-1, 16] and
# invisible ones in x ∈ [-20, 39], y ∈ [-16, 31].
_INVISIBLE = np.zeros((6, 5), bool)
_INVISIBLE[:, :4] = True  # point 4 is never visible


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"visibility": np.where(_clip()[2], 4, -3).astype(np.int8)},
            r"`visibility` must be bool, or int8 holding only 0 and 1, but \d+ entries hold other values: -3, 4",
        ),
        (
            {"visibility": _changed(2, 1, 0.5, _clip()[2].astype(np.float64))},
            r"`visibility` must be bool, or float64 holding only 0 and 1, but 1 entries hold other values: 0.5",
        ),
        (
            {"visibility": _changed(0, 0, np.nan, _clip()[2].astype(np.float32))},
            r"but 1 entries hold other values: nan",
        ),
        ({"tracks": _changed(3, 2, [np.inf, 1.0])}, r"1 positions that are NaN or infinite, .* point 2 in frame 3"),
        (
            {"tracks": _changed(0, 3, [45.0, 2.0]), "visibility": np.ones((6, 5), bool)},
            r"point 3 is marked visible in frame 0 at \(x, y\) = \(45, 2\), outside the 20×16 \(W×H\) frame:"
            r" visible points must lie within x ∈ \[-1, 20\] and y ∈ \[-1, 16\]",
        ),
        (
            {"tracks": _changed(5, 0, [3.0, -1.5]), "visibility": np.ones((6, 5), bool)},
            r"point 0 is marked visible in frame 5 at \(x, y\) = \(3, -1.5\), outside the 20×16",
        ),
        (
            {"tracks": _changed(4, 4, [-25.0, 3.0]), "visibility": _INVISIBLE},
            r"point 4 \(marked invisible\) lies at \(x, y\) = \(-25, 3\) in frame 4, more than one frame size"
            r" outside the 20×16 \(W×H\) frame: .* x ∈ \[-20, 39\] and y ∈ \[-16, 31\]; 1 position is",
        ),
        (
            {"tracks": _changed(1, 4, [3.0, 1e6]), "visibility": _INVISIBLE},
            r"point 4 \(marked invisible\) lies at \(x, y\) = \(3, 1e\+06\) in frame 1",
        ),
    ],
)
def test_bad_visibility_and_positions_name_the_file_the_point_and_the_value(tmp_path, change, message):
    arrays = dict(zip(("video", "tracks", "visibility"), _clip(), strict=True))
    arrays.update(change)
    file = _write(tmp_path / "odd.npz", **arrays)
    with pytest.raises(ValueError, match=r"odd\.npz'.*" + message):
        read_tracking_clip(file)


def test_positions_within_the_tolerances_are_accepted(tmp_path):
    video, tracks, _ = _clip()
    tracks[0, :4] = [[-1.0, -1.0], [20.0, 16.0], [-0.5, 7.0], [19.5, 15.5]]  # visible: 1 px past the pixel centres
    tracks[0, 4] = [39.0, -16.0]  # invisible: one frame size past the edges
    visibility = _INVISIBLE.copy()
    file = _write(tmp_path / "edges.npz", video=video, tracks=tracks, visibility=visibility)
    assert np.array_equal(read_tracking_clip(file)[1][0], tracks[0].astype(np.float32))


def test_a_truncated_or_corrupt_archive_names_the_file(tmp_path):
    whole = tmp_path / "whole.npz"
    np.savez_compressed(whole, **dict(zip(("video", "tracks", "visibility"), _clip(), strict=True)))
    data = whole.read_bytes()
    for cut in (1, 100, len(data) // 2, len(data) - 10):
        (tmp_path / "cut.npz").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cannot read '.*cut\.npz' as a \.npz archive"):
            read_tracking_clip(tmp_path / "cut.npz")
    corrupt = bytearray(data)
    corrupt[200:240] = bytes(40)  # inside the compressed `video` member
    (tmp_path / "corrupt.npz").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match=r"cannot read '.*corrupt\.npz': an array in it is truncated or corrupt"):
        read_tracking_clip(tmp_path / "corrupt.npz")


def test_a_batch_of_clips_of_different_sizes_names_the_files_and_sizes(tmp_path):
    write_tracking_clip(tmp_path / "a.npz", *_clip(frames=6))
    write_tracking_clip(tmp_path / "b.npz", *_clip(frames=6, size=(24, 20)))
    write_tracking_clip(tmp_path / "c.npz", *_clip(frames=8))
    dm = TrackingNpzDataModule(str(tmp_path), traj_per_sample=3, batch_size=3)
    message = (
        r"cannot batch tracking clips of different sizes: .*a\.npz: 6 frames of 16×20 \(H×W\), 3 tracks|"
        r"6 frames of 16×20 \(H×W\), 3 tracks: .*a\.npz"
    )
    with pytest.raises(ValueError, match=message) as caught:
        next(iter(dm.train_dataloader()))
    text = str(caught.value)
    assert "b.npz" in text and "6 frames of 24×20 (H×W)" in text and "c.npz" in text and "8 frames of 16×20" in text
    assert "set `sequence_len`" in text
    cropped = TrackingNpzDataModule(str(tmp_path), traj_per_sample=3, sequence_len=6, batch_size=3)
    with pytest.raises(ValueError, match=r"6 frames of 24×20 \(H×W\), 3 tracks: [^;]*b\.npz(;|\.)") as caught:
        next(iter(cropped.train_dataloader()))
    assert "a.npz" in str(caught.value) and "c.npz" in str(caught.value)  # the other size: 6 frames of 16×20


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
    with pytest.raises(ValueError, match=r"`traj_per_sample` must be an integer ≥ 1, got 0"):
        TrackingNpzDataModule(str(tmp_path), traj_per_sample=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"root": None}, TypeError, r"`root` must be a path, got None \(NoneType\)"),
        ({"root": "{tmp}/missing"}, FileNotFoundError, r"`root` '.*missing' does not exist or is not a directory"),
        ({"root": "{tmp}/clip0.npz"}, FileNotFoundError, r"`root` '.*clip0\.npz' does not exist or is not a dir"),
        ({"traj_per_sample": "256"}, TypeError, r"`traj_per_sample` must be an integer ≥ 1, got '256' \(str\)"),
        ({"sequence_len": 1}, ValueError, r"`sequence_len` must be an integer ≥ 2, got 1"),
        ({"sequence_len": "all"}, TypeError, r"`sequence_len` must be an integer ≥ 2, got 'all' \(str\)"),
        ({"val_fraction": 1.0}, ValueError, r"`val_fraction` must be a number ≥ 0 and < 1, got 1.0"),
        ({"val_fraction": "10%"}, TypeError, r"`val_fraction` must be a number ≥ 0 and < 1, got '10%' \(str\)"),
        ({"seed": -1}, ValueError, r"`seed` must be an integer ≥ 0, got -1"),
        ({"batch_size": "abc"}, TypeError, r"`batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"pin_memory": "of"}, ValueError, r"`pin_memory` must be true or false, got 'of' \(str\)"),
        ({"num_workers": 0, "persistent_workers": "yes"}, ValueError, r"`persistent_workers=True` needs worker"),
    ],
)
def test_bad_datamodule_arguments_name_the_argument_and_the_value(tmp_path, kwargs, error, message):
    write_tracking_clip(tmp_path / "clip0.npz", *_clip())
    arguments = {"root": str(tmp_path), **kwargs}
    if isinstance(arguments["root"], str):
        arguments["root"] = arguments["root"].format(tmp=tmp_path)
    with pytest.raises(error, match=message):
        TrackingNpzDataModule(**arguments)


def test_boolean_words_are_read_strictly(tmp_path):
    write_tracking_clip(tmp_path / "clip0.npz", *_clip())
    dm = TrackingNpzDataModule(str(tmp_path), pin_memory="off", drop_last="no", batch_size=1)
    assert dm.loader_options["pin_memory"] is False and dm.drop_last is False


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"files": "clip.npz"}, TypeError, r"`files` must be a list of clip files, got 'clip\.npz' \(str\)"),
        ({"files": [None]}, TypeError, r"`files` must be a path, got None"),
        ({"traj_per_sample": 0}, ValueError, r"`traj_per_sample` must be an integer ≥ 1, got 0"),
        ({"sequence_len": 1}, ValueError, r"`sequence_len` must be an integer ≥ 2, got 1"),
        ({"seed": "0"}, TypeError, r"`seed` must be an integer ≥ 0, got '0' \(str\)"),
    ],
)
def test_bad_dataset_arguments_are_refused(kwargs, error, message):
    arguments = {"files": ["clip.npz"], "traj_per_sample": 2, "sequence_len": None, "seed": 0, **kwargs}
    with pytest.raises(error, match=message):
        TrackingNpzDataset(**arguments)
