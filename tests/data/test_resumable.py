"""ResumableDataLoader / ResumableSampler: the order is a function of (seed, epoch); the position survives a resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from lightning_memopt.data.resumable import EpochIndex, ResumableDataLoader, ResumableSampler, sample_generator


def _epoch(loader: ResumableDataLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch.tolist() for batch in loader]


def test_order_depends_on_seed_and_epoch_only():
    a, b = ResumableDataLoader(range(20), batch_size=4, seed=1), ResumableDataLoader(range(20), batch_size=4, seed=1)
    assert _epoch(a, 0) == _epoch(b, 0)
    assert _epoch(a, 1) == _epoch(b, 1) != _epoch(a, 0)
    assert _epoch(ResumableDataLoader(range(20), batch_size=4, seed=2), 0) != _epoch(a, 0)
    assert sorted(sum(_epoch(a, 3), [])) == list(range(20))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("taken", [0, 1, 3])
def test_a_loaded_state_yields_the_rest_of_the_epoch(num_workers, taken):
    loader = ResumableDataLoader(range(24), batch_size=4, seed=5, num_workers=num_workers)
    loader.sampler.set_epoch(2)
    batches = iter(loader)
    seen = [next(batches).tolist() for _ in range(taken)]
    state = loader.state_dict()
    rest = [batch.tolist() for batch in batches]
    assert state == {"epoch": 2, "consumed": 4 * taken, "world_size": 1, "seed": 5}
    resumed = ResumableDataLoader(range(24), batch_size=4, seed=5, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest
    assert len(resumed) == 6  # the full epoch's length, as Lightning expects
    assert seen + rest == _epoch(ResumableDataLoader(range(24), batch_size=4, seed=5), 2)


def test_a_whole_epoch_resumes_at_the_next_one():
    loader = ResumableDataLoader(range(10), batch_size=4, seed=0, drop_last=True)
    list(loader)
    state = loader.state_dict()
    assert state == {"epoch": 0, "consumed": 8, "world_size": 1, "seed": 0}
    resumed = ResumableDataLoader(range(10), batch_size=4, seed=0, drop_last=True)
    resumed.load_state_dict(state)
    assert resumed.sampler.epoch == 1
    assert [batch.tolist() for batch in resumed] == _epoch(ResumableDataLoader(range(10), 4, seed=0, drop_last=True), 1)


def test_another_world_size_continues_after_the_same_share_with_a_warning():
    resumed = ResumableDataLoader(range(16), batch_size=2, seed=0)
    with pytest.warns(UserWarning, match="checkpoint of 2 rank"):
        resumed.load_state_dict({"epoch": 0, "consumed": 4, "world_size": 2, "seed": 0})
    assert len(list(resumed)) == 4  # 8 of 16 samples were consumed over 2 ranks


def test_the_seed_comes_from_seed_everything(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert ResumableSampler(range(4)).seed == 7


class _Keys(Dataset):
    takes_epoch_keys = True

    def __len__(self) -> int:
        return 4

    def __getitem__(self, key: EpochIndex) -> tuple[int, int]:
        return key.epoch, key.index


def test_a_dataset_that_takes_epoch_keys_gets_the_epoch_with_the_index():
    loader = ResumableDataLoader(_Keys(), batch_size=4, shuffle=False)
    loader.sampler.set_epoch(3)
    epochs, indices = next(iter(loader))
    assert epochs.tolist() == [3, 3, 3, 3] and indices.tolist() == [0, 1, 2, 3]


def test_a_sample_generator_depends_on_its_key_alone():
    draw = lambda *key: torch.rand(3, generator=sample_generator(*key)).tolist()  # noqa: E731
    assert draw(0, 1, 2) == draw(0, 1, 2)
    assert len({tuple(draw(0, 1, 2)), tuple(draw(0, 2, 2)), tuple(draw(0, 1, 3)), tuple(draw(1, 1, 2))}) == 4
