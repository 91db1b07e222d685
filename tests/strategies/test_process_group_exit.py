"""Fits under our DDP strategy end with their process groups destroyed before the interpreter finalises."""

import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_ranks

SCRIPT = Path(__file__).with_name("exit_run.py")


def _launch(tmp_path: Path, fits: int) -> list[subprocess.CompletedProcess]:
    return run_ranks(SCRIPT, [str(tmp_path), str(fits)], cwd=tmp_path, timeout=240)


def _clean(rank: subprocess.CompletedProcess) -> bool:
    return rank.returncode == 0 and "terminate called" not in rank.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_powersgd_fits_leave_no_process_group_to_the_interpreters_exit(tmp_path):
    ranks = _launch(tmp_path, fits=2)
    # the probe runs after our handler, before the interpreter finalises (the rare abort below comes after it)
    assert [(tmp_path / f"exit{rank}.txt").read_text() for rank in (0, 1)] == ["initialized=False"] * 2, [
        rank.stdout[-3000:] for rank in ranks
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_repeated_powersgd_launches_abort_far_less_often_than_before(tmp_path, monkeypatch):
    """Without collecting garbage before the groups are destroyed, 4 of 13 launches aborted after their fits had
    succeeded ("Resource deadlock avoided"); with it, about 1 in 100 still does (1 of about 110 launches seen,
    in CI). Of 16 launches at most one may abort: at 4 in 13 that passes 2 % of the time, at 1 in 100 it fails 1 %
    of the time."""
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # an abort prints every thread's Python stack: where it happened
    unclean = []
    for launch in range(16):
        folder = tmp_path / str(launch)
        folder.mkdir()
        ranks = _launch(folder, fits=2)
        if not all(_clean(rank) for rank in ranks):
            unclean.append([rank.stdout[-2000:] for rank in ranks if not _clean(rank)])
    assert len(unclean) <= 1, unclean
