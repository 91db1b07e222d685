"""Fits under our DDP strategy end with their process groups destroyed before the interpreter finalises."""

from pathlib import Path

import pytest

from tests.helpers import run_ranks

SCRIPT = Path(__file__).with_name("exit_run.py")


def _run(tmp_path: Path, fits: int) -> None:
    for rank in run_ranks(SCRIPT, [str(tmp_path), str(fits)], cwd=tmp_path, timeout=240):
        assert rank.returncode == 0, rank.stdout[-3000:]
        assert "terminate called" not in rank.stdout, rank.stdout[-3000:]


@pytest.mark.distributed
def test_powersgd_fits_leave_no_process_group_to_the_interpreters_exit(tmp_path):
    _run(tmp_path, fits=2)
    assert [(tmp_path / f"exit{rank}.txt").read_text() for rank in (0, 1)] == ["initialized=False"] * 2


@pytest.mark.slow
@pytest.mark.distributed
def test_repeated_powersgd_launches_all_exit_cleanly(tmp_path):
    """Before the groups were destroyed at exit, about one launch in 14 aborted after its fits had succeeded."""
    for launch in range(8):
        folder = tmp_path / str(launch)
        folder.mkdir()
        _run(folder, fits=2)
