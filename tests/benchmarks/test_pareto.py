"""benchmarks/pareto.py: the Pareto front of a memory_grid sweep, and the fastest run within a budget."""

import csv

import pytest

from tests.helpers import load_benchmark

pareto = load_benchmark("pareto")
SweepRun, fastest_within, labels, pareto_front, read_sweep, table = (
    pareto.SweepRun,
    pareto.fastest_within,
    pareto.labels,
    pareto.pareto_front,
    pareto.read_sweep,
    pareto.table,
)

_KNOB = "memopt.callbacks.memory_budget.knobs."
RUNS = [
    SweepRun(("model=x", f"{_KNOB}checkpoint=none"), 300, 10.0),
    SweepRun(("model=x", f"{_KNOB}checkpoint=selective"), 200, 9.0),
    SweepRun(("model=x", f"{_KNOB}checkpoint=full"), 100, 6.0),
    SweepRun(("model=x", f"{_KNOB}micro_batch_size=2"), 250, 8.0),  # beaten by selective: less memory, faster
    SweepRun(("model=x", f"{_KNOB}precision=bf16-mixed"), 300, 7.0),  # beaten by none: same memory, faster
]


def _brute_force_front(runs):
    def beaten(run):
        return any(
            other.peak_bytes <= run.peak_bytes
            and other.samples_per_second >= run.samples_per_second
            and (other.peak_bytes, other.samples_per_second) != (run.peak_bytes, run.samples_per_second)
            for other in runs
        )

    return sorted((run for run in runs if not beaten(run)), key=lambda run: run.peak_bytes)


def test_the_front_is_what_no_other_run_beats():
    assert pareto_front(RUNS) == _brute_force_front(RUNS) == [RUNS[2], RUNS[1], RUNS[0]]


def test_the_fastest_run_within_a_budget():
    assert fastest_within(RUNS, 260) is RUNS[1]
    assert fastest_within(RUNS, 300) is RUNS[0]
    assert fastest_within(RUNS, 99) is None


def test_labels_drop_the_shared_overrides_and_the_knob_prefix():
    assert labels(RUNS[:2]) == ["checkpoint=none", "checkpoint=selective"]
    printed = table(RUNS, budget_bytes=260)
    lines = printed.splitlines()
    assert lines[1].startswith("checkpoint=full") and lines[1].split()[-2:] == ["yes", "yes"]
    assert "micro_batch_size=2" in printed and "model=x" not in printed


def test_the_sweep_csv_is_read_and_a_file_without_the_columns_is_refused(tmp_path):
    path = tmp_path / "grid.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "steps", "peak_memory_bytes", "samples_per_second"])
        writer.writerow(["model=x a=1", "8", "1024", "3.5"])
        writer.writerow(["model=x a=2", "0", "", "0.0"])  # a run that never reached its counted batch
    assert read_sweep(path) == [SweepRun(("model=x", "a=1"), 1024, 3.5)]
    other = tmp_path / "other.csv"
    other.write_text("label,loss\nx,1\n")
    with pytest.raises(ValueError, match=r"lacks the columns \['peak_memory_bytes', 'samples_per_second'\]"):
        read_sweep(other)
