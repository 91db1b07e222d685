"""The table a multirun ends with: one row per job — its overrides, objective, peak memory and samples/s.

Each ``memopt-train`` job writes ``job_summary.json`` into its own output folder (:func:`write_job_summary`);
:class:`MultirunTable`, a Hydra callback (``hydra.callbacks.multirun_table`` in ``train.yaml``), reads them
from the sweep's folder when the sweep ends, so it works with every launcher (jobs in this process, in
joblib workers or on SLURM).

Example::

    >>> print(format_table([{"job": 0, "overrides": "model=r18", "objective": "val/acc 0.5",
    ...                      "peak_memory_bytes": 2**30, "samples_per_second": 12.5, "final_loss": 1.25}]))
    job  overrides  objective    peak memory  samples/s  final loss
      0  model=r18  val/acc 0.5     1.00 GiB       12.5      1.2500
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_memopt.vocabulary import aligned_table, format_bytes

SUMMARY_FILE = "job_summary.json"


def write_job_summary(folder: str | Path, overrides: list[str], summary: Any, objective: str) -> Path:
    """Write a finished job's figures (a :class:`~lightning_memopt.callbacks.training_summary.FitSummary`)."""
    path = Path(folder) / SUMMARY_FILE
    figures = {
        "overrides": " ".join(overrides),
        "objective": objective,
        "peak_memory_bytes": summary.peak_memory_bytes,
        "peak_rss_bytes": summary.peak_rss_bytes,
        "samples_per_second": summary.samples_per_second,
        "final_loss": summary.final_loss,
    }
    path.write_text(json.dumps(figures))
    return path


def read_job_summaries(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every job summary under ``sweep_dir`` (one folder per job, named by its number), in job order."""
    rows = []
    for path in Path(sweep_dir).glob(f"*/{SUMMARY_FILE}"):
        row = json.loads(path.read_text())
        row["job"] = int(path.parent.name) if path.parent.name.isdigit() else path.parent.name
        rows.append(row)
    return sorted(rows, key=lambda row: (isinstance(row["job"], str), row["job"]))


def format_table(rows: list[dict[str, Any]]) -> str:
    """The jobs as an aligned plain-text table: the overrides that differ between them, then those they share."""
    overrides = [row["overrides"].split() for row in rows]
    shared = [o for o in overrides[0] if all(o in others for others in overrides[1:])] if len(rows) > 1 else []
    header = ["job", "overrides", "objective", "peak memory", "samples/s", "final loss"]
    body = [
        [
            str(row["job"]),
            " ".join(o for o in own if o not in shared) or "(none)",
            row["objective"] or "n/a",
            _peak(row),
            f"{row['samples_per_second']:.1f}",
            "n/a" if row["final_loss"] is None else f"{row['final_loss']:.4f}",
        ]
        for row, own in zip(rows, overrides, strict=True)
    ]
    lines = aligned_table(header, body, left=frozenset({1, 2}))  # the text columns; numbers align right
    return "\n".join([*lines, *([f"every job: {' '.join(shared)}"] if shared else [])])


def _peak(row: dict[str, Any]) -> str:
    """A job's peak tensor bytes, else its process's peak resident set size (marked), else ``n/a``."""
    if row["peak_memory_bytes"] is not None:
        return format_bytes(row["peak_memory_bytes"])
    rss = row.get("peak_rss_bytes")  # (absent from summaries written by earlier versions)
    return "n/a" if rss is None else f"{format_bytes(rss)} resident"


class MultirunTable(Callback):
    """Print the table of the sweep's jobs when a multirun ends (jobs that failed have no row, and it says so)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = read_job_summaries(sweep_dir)
        started = sum(1 for path in sweep_dir.iterdir() if path.is_dir() and path.name.isdigit())
        if not rows:
            print(f"memopt-train: no job of the multirun in {sweep_dir} finished", flush=True)
            return
        missing = f" ({started - len(rows)} of {started} jobs did not finish)" if started > len(rows) else ""
        print(f"memopt-train: the multirun's {len(rows)} jobs{missing}, in {sweep_dir}:", flush=True)
        print(format_table(rows), flush=True)
