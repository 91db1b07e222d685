"""The CPU's rates are timed once per machine and cached: a plan's step times do not move with the machine's load."""

from __future__ import annotations

import json

import pytest

from lightning_memopt.planner import calibration
from lightning_memopt.planner.calibration import CACHE_VARIABLE
from tests.conftest import RATES_CACHE_VARIABLE


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(calibration, "_MEASURED", {})
    return tmp_path / "cpu_rates.json"


def test_the_test_run_keeps_its_own_cache():
    assert RATES_CACHE_VARIABLE == CACHE_VARIABLE
    assert calibration.cache_path().parent.name.startswith("memopt_rates_")


def test_the_rates_are_timed_once_and_read_back_in_a_new_process(fresh_cache, monkeypatch):
    first = calibration.measure_cpu(2**20)
    stored = json.loads(fresh_cache.read_text())
    assert list(stored) == [calibration.machine_key()]
    monkeypatch.setattr(calibration, "_MEASURED", {})  # as a new process finds it: only the file

    def no_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(calibration, "_timed_rates", no_timing)
    again = calibration.measure_cpu(2**30)
    assert again == calibration.dataclasses.replace(first, memory_bytes=2**30)  # every rate as it was timed


def test_refresh_times_them_again_and_a_damaged_file_is_replaced(fresh_cache, monkeypatch):
    fresh_cache.write_text("{not json")
    timed = []
    real = calibration._timed_rates
    monkeypatch.setattr(calibration, "_timed_rates", lambda *args: timed.append(args) or real(*args))
    calibration.measure_cpu(0)
    assert len(timed) == 1 and calibration.machine_key() in json.loads(fresh_cache.read_text())
    calibration.measure_cpu(0)
    calibration.measure_cpu(0, refresh=True)
    assert len(timed) == 2
