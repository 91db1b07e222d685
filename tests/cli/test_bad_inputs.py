"""Every bad input of the table in benchmarks/claims/bad_inputs.py ends with exit status 2 and one clean line
naming it."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark, run_memopt_train

bad_inputs = load_benchmark("claims.bad_inputs")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_inputs")
    bad_inputs.make_inputs(folder)
    return folder


def test_the_table_covers_every_option_group_and_data_format():
    from pathlib import Path

    from lightning_memopt.cli.config import config_dir

    groups = {case.group for case in bad_inputs.CASES}
    conf = Path(config_dir())
    option_groups = {path.name for path in conf.iterdir() if path.is_dir() and path.name not in ("hydra", "paths")}
    assert option_groups <= groups, option_groups - groups
    data_formats = {path.stem for path in (conf / "data").glob("*.yaml")}
    assert data_formats - {"synthetic_face"} <= groups, data_formats - groups  # synthetic_face: the `data` group
    assert {case.app for case in bad_inputs.CASES} == {
        "memopt-train",
        "memopt-plan",
        "memopt-profile",
        "memopt-pack-faces",
        "memopt-export",
    }


@pytest.mark.parametrize("case", bad_inputs.CASES, ids=lambda case: case.name)
def test_a_bad_input_ends_with_one_clean_line_and_status_2(case, scratch, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    outcome = bad_inputs.run_case(case, scratch)
    assert outcome.status == 2, outcome.output[-3000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    message = bad_inputs.last_line(outcome.output)
    for part in case.expect:
        assert part in outcome.output, f"{part!r} not in {message!r}"


def test_debug_shows_the_traceback_of_a_bad_input(tmp_path):
    args = ["model=iresnet_tiny", "data.batch_size=abc", "logger=none", "--debug"]
    result = run_memopt_train(args, cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "`batch_size` must be an integer ≥ 1, got 'abc' (str)" in result.stderr


def test_a_bad_input_in_a_subprocess_prints_one_line_on_stderr(tmp_path):
    result = run_memopt_train(["model=iresnet_tiny", "data.batch_size=abc", "logger=none"], cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1]
        == "memopt-train: `data.batch_size` must be an integer ≥ 1, got 'abc' (str)"
    )
    assert "Traceback" not in result.stderr + result.stdout


def test_a_fault_during_the_fit_keeps_its_traceback_and_status_1(tmp_path):
    args = ["model=iresnet_tiny", "logger=none", "+callbacks.fault={_target_:tests.cli.faults.FaultAtFirstBatch}"]
    result = run_memopt_train(args, cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "mat1 and mat2 shapes cannot be multiplied" in result.stderr
