"""A multirun ends with one table of its jobs: overrides, objective, peak memory, samples/s."""

from __future__ import annotations

import json

import pytest

from lightning_memopt.cli.multirun_table import SUMMARY_FILE, format_table, read_job_summaries
from tests.helpers import TINY_FACE, run_memopt_train


def test_the_table_reads_every_finished_job_in_order(tmp_path):
    for job, loss in ((10, 0.5), (2, 1.0)):
        (tmp_path / str(job)).mkdir()
        figures = {"overrides": f"seed={job}", "objective": "", "peak_memory_bytes": None,
                   "samples_per_second": 3.0, "final_loss": loss}  # fmt: skip
        (tmp_path / str(job) / SUMMARY_FILE).write_text(json.dumps(figures))
    rows = read_job_summaries(tmp_path)
    assert [row["job"] for row in rows] == [2, 10]  # by number, not by name
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["job", "overrides", "objective", "peak", "memory", "samples/s", "final", "loss"]
    assert lines[1].split() == ["2", "seed=2", "n/a", "n/a", "3.0", "1.0000"]


def test_a_job_with_only_the_process_peak_shows_it_marked_resident():
    figures = {"job": 0, "overrides": "seed=1", "objective": "", "samples_per_second": 3.0, "final_loss": None}
    row = {**figures, "peak_memory_bytes": None, "peak_rss_bytes": 3 * 2**29}
    assert "1.50 GiB resident" in format_table([row])
    assert " n/a " in format_table([{**figures, "peak_memory_bytes": None}])  # a summary of an earlier version


@pytest.mark.slow
def test_memopt_train_multirun_ends_with_the_table_of_its_jobs(tmp_path):
    done = run_memopt_train(["-m", *TINY_FACE, "seed=1,2", f"paths.log_dir={tmp_path}"], tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memopt-train: the multirun's 2 jobs, in "))
    header, first, second, shared = lines[start + 1 : start + 5]
    assert header.split()[:3] == ["job", "overrides", "objective"]
    assert first.split()[:2] == ["0", "seed=1"] and second.split()[:2] == ["1", "seed=2"]  # what differs
    assert all(row.split()[-3] == "MiB" for row in (first, second))  # the tracker's peak on the CPU
    assert shared.startswith("every job: model.backbone=iresnet_tiny ")
