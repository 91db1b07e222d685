import numpy as np
import pytest
import torch

from lightning_memopt.data.tracking_sample import select_tracks, tracking_sample


def test_tracks_never_visible_are_never_chosen():
    visibility = np.array([[True, False, False, True], [True, False, True, True]])
    for seed in range(5):
        chosen = select_tracks(visibility, 3, np.random.default_rng(seed))
        assert sorted(chosen.tolist()) == [0, 2, 3]


def test_tracks_visible_in_the_first_frame_come_first():
    visibility = np.zeros((3, 10), dtype=bool)
    visibility[0, [2, 5, 7]] = True  # visible from frame 0
    visibility[2, :] = True  # every track is visible at the end
    chosen = select_tracks(visibility, 3, np.random.default_rng(0))
    assert sorted(chosen.tolist()) == [2, 5, 7]


def test_fewer_visible_tracks_than_asked_are_repeated_in_order():
    visibility = np.array([[True, False, True], [True, False, True]])
    chosen = select_tracks(visibility, 5, np.random.default_rng(0))
    assert len(chosen) == 5 and set(chosen.tolist()) == {0, 2}
    assert chosen[2:4].tolist() == chosen[:2].tolist() and chosen[4] == chosen[0]


def test_no_visible_track_is_an_error():
    with pytest.raises(ValueError, match="none of the 3 tracks is visible in any of the 2 frames"):
        select_tracks(np.zeros((2, 3), dtype=bool), 1, np.random.default_rng(0))


def test_queries_are_the_first_visible_frame_and_position():
    tracks = np.random.default_rng(0).uniform(0, 30, size=(4, 6, 2)).astype(np.float32)
    visibility = np.ones((4, 6), dtype=bool)
    visibility[:2, 1] = False  # track 1 appears in frame 2
    visibility[:, 4] = False  # track 4 is never seen
    sample = tracking_sample(torch.zeros(4, 3, 8, 8), tracks, visibility, 5, np.random.default_rng(1))
    assert sample["tracks"].shape == (4, 5, 2) and sample["queries"].shape == (5, 3)
    assert sample["visibility"].dtype == torch.bool and sample["tracks"].dtype == torch.float32
    for n in range(5):
        frame = int(sample["queries"][n, 0])
        assert sample["visibility"][frame, n] and not sample["visibility"][:frame, n].any()
        torch.testing.assert_close(sample["queries"][n, 1:], sample["tracks"][frame, n])
    assert sorted(sample["queries"][:, 0].tolist()) == [0.0, 0.0, 0.0, 0.0, 2.0]
