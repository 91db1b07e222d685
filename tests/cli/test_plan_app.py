import csv

import pytest

from tests.helpers import REPO_ROOT, TINY_NORMALS, run_memopt_train, run_python

_KNOB = "memopt.callbacks.memory_budget.knobs."
TINY_PLAN = ["model=sapiens_tiny", "data.image_size=[64,48]", "data.batch_size=2"]


def _memopt_plan(args, cwd):
    return run_python(["-m", "lightning_memopt.cli.plan", *args], cwd, timeout=600)


@pytest.mark.slow
def test_memopt_plan_prints_the_candidates_the_choice_and_its_command_and_writes_the_chart(tmp_path):
    pytest.importorskip("matplotlib")
    result = _memopt_plan([*TINY_PLAN, "budget=0.02", "plan.png=plan.png"], tmp_path)  # (A100 cuBLAS: 16 MiB)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    answer, table = out.split("\n\n", 1)  # the answer first: the choice and its command, then the table
    assert answer.splitlines()[1].startswith("chosen: ") and "candidate" in table and "peak MiB" in table
    command = answer.split("run it with:\n")[1].strip()
    assert command.startswith("memopt-train model=sapiens_tiny 'data.image_size=[64,48]' data.batch_size=2 ")
    assert "data=synthetic_normals" in command and command.split()[-1].startswith("'knobs={precision:")
    assert "budget=" not in command.replace("compile_budget", "") and len(command) < 250
    header = table.splitlines()[0].split()
    assert "gradients" in header and "optimizer" in header and "activations" in header  # full column names
    assert "backbone sapiens_tiny" not in out  # the tiny preset has no smaller sibling
    assert "patch_size 16 → 32" not in out  # measured, and it saves nothing at this size: not listed
    progress = [line for line in result.stderr.splitlines() if line.startswith("memopt-plan: profil")]
    assert len(progress) == 1, result.stderr  # no terminal: the progress in a few lines, not one per profile
    assert (tmp_path / "plan.png").stat().st_size > 1000


@pytest.mark.slow
def test_memopt_plan_measures_on_the_machine_it_runs_on_when_asked(tmp_path):
    measuring = ["plan.measure=refresh", "plan.measure_candidates=2", "plan.options=false"]
    result = _memopt_plan([*TINY_PLAN, "budget=0.05", *measuring], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "measured on cpu: tried 2 of 2 candidates on the device" in out
    chosen = out.split("chosen by measurement: ")[1].split("\n")[0].split(" (the price")[0].split(", as the price")[0]
    assert f"knobs={{precision:{chosen.split(',')[0]}" in out.split("run it with:\n")[1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("gpu=a6000", "Unknown `gpu`='a6000'; valid names: v100_16gb, v100_32gb, t4_16gb"),
        ("budget=0.00005", "is smaller than the model states alone"),  # (offloaded, 0.5 MiB is planned)
        ("plan.measure=maybe", "`plan.measure`='maybe' is not one of the valid choices: true, false, refresh"),
    ],
)
def test_memopt_plan_names_bad_input(tmp_path, override, message):
    result = _memopt_plan([*TINY_PLAN, override], tmp_path)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.slow
def test_the_memory_grid_sweep_writes_one_csv_row_per_run(tmp_path):
    grid = [f"{_KNOB}precision=32-true", f"{_KNOB}checkpoint=none,full", f"{_KNOB}micro_batch_size=null"]
    result = run_memopt_train(
        [
            "-m",
            "sweep=memory_grid",
            "model=sapiens_tiny",
            "data=synthetic_normals",
            *TINY_NORMALS,
            "trainer.max_steps=3",
            *grid,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("logs/train/multiruns/*/memory_grid.csv")
    with path.open(newline="") as handle:
        rows = {row["label"].split(f"{_KNOB}checkpoint=")[1].split()[0]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"none", "full"}
    assert all("MemoryTracker" in row["peak_memory_source"] for row in rows.values())
    assert int(rows["full"]["peak_memory_bytes"]) < int(rows["none"]["peak_memory_bytes"])
    assert all(float(row["samples_per_second"]) > 0 for row in rows.values())


def test_the_pareto_script_reads_the_sweep(tmp_path):
    path = tmp_path / "grid.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "peak_memory_bytes", "samples_per_second"])
        writer.writerows([[f"{_KNOB}checkpoint=none", 3 * 2**20, 9.0], [f"{_KNOB}checkpoint=full", 2**20, 6.0]])
    result = run_python([str(REPO_ROOT / "benchmarks" / "pareto.py"), str(path), "--budget-mib", "2"], tmp_path, 120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fastest within 2.0 MiB: checkpoint=full" in result.stdout


def test_memopt_plan_with_blocks_that_match_nothing_exits_with_its_reason(tmp_path):
    result = _memopt_plan([*TINY_PLAN, "plan.blocks=[decoder.*]", "plan.options=false"], tmp_path)
    assert result.returncode == 2
    assert "memopt-plan: `plan.blocks`=['decoder.*'] match no module of the model" in result.stderr
    assert "Traceback" not in result.stderr
