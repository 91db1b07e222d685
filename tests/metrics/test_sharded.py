import pytest
import torch

from lightning_memopt.metrics import sharded


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:3"), ("xccl", "xpu:1")],
)
def test_the_communication_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(sharded.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(sharded.torch.cuda, "current_device", lambda: 3)
    assert sharded.communication_device(fallback=torch.device("xpu", 1)) == torch.device(expected)


def test_outside_ddp_rows_stay_local_and_repeats_are_found():
    rows = torch.arange(10).view(5, 2)
    assert sharded.rows_per_rank(5) == [5]
    assert sharded.max_over_ranks([3, 0, 1]) == [3, 0, 1]
    assert sharded.gather_rows(rows, [5]) is rows
    keep = sharded.first_occurrence(torch.tensor([3, 1, 3, 3, 0]))
    assert keep.tolist() == [True, True, False, False, True]
    assert sharded.gather_rows(rows, [5], keep=keep).tolist() == [[0, 1], [2, 3], [8, 9]]
