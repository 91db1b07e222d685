"""Rows kept when 8 processes append to one results CSV at the same moment: the old append versus the locked one.

    python benchmarks/claims/concurrent_rows.py [--trials 20] [--writers 8]
    python benchmarks/claims/concurrent_rows.py --table     # the docs table from the CSV

Each trial starts ``--writers`` processes (fork where the platform has it) on a new file; they wait
at a barrier and then each appends one row, as the jobs of a Hydra sweep ending together do with
``TrainingSummary(csv_path=...)``. ``naive`` is the append ``TrainingSummary`` used before issue 23
(header check, then ``open("w")`` for a new file or ``open("a")``, no lock); ``locked`` is
:func:`lightning_memopt.results_file.append_row`. A row counts as kept if it is a whole row of one of
the writers; a trial loses rows if fewer than ``--writers`` distinct rows remain. Writes
concurrent_rows.csv next to this script.
"""

from __future__ import annotations

import csv
import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

from lightning_memopt.results_file import append_row

COLUMNS = ["label", "steps", "samples", "train_seconds", "final_loss", "peak_memory_bytes"]


def naive_append_row(path: Path, row: dict[str, Any]) -> None:
    """The unlocked append of ``TrainingSummary`` before issue 23."""
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as handle:
            header = next(csv.reader(handle))
        if header != list(row):
            raise ValueError(f"{str(path)!r} has the columns {header}, not {list(row)}")
        with path.open("a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=header).writerow(row)
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)


def _row(index: int) -> dict[str, Any]:
    return {
        "label": f"data.batch_size={2**index}",
        "steps": 20,
        "samples": 20 * 2**index,
        "train_seconds": 1.0 + index / 7,
        "final_loss": 1.0 / (index + 1),
        "peak_memory_bytes": 123456789 * (index + 1),
    }


def _writer(method: str, barrier: Any, path: str, index: int) -> None:
    barrier.wait()
    (append_row if method == "locked" else naive_append_row)(Path(path), _row(index))


def _kept(path: Path, writers: int) -> tuple[int, int]:
    """(distinct whole rows of the writers, header lines) in the file."""
    if not path.exists():
        return 0, 0
    with path.open(newline="") as handle:
        lines = list(csv.reader(handle))
    wanted = {tuple(str(value) for value in _row(index).values()) for index in range(writers)}
    return len({tuple(line) for line in lines} & wanted), sum(line == COLUMNS for line in lines)


def measure(method: str, trials: int, writers: int, folder: Path) -> dict[str, Any]:
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    kept = lossy = extra_headers = 0
    for trial in range(trials):
        path = folder / f"{method}-{trial}.csv"
        barrier = context.Barrier(writers)
        processes = [context.Process(target=_writer, args=(method, barrier, str(path), i)) for i in range(writers)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        rows, headers = _kept(path, writers)
        kept += rows
        lossy += rows < writers
        extra_headers += headers > 1
    print(f"{method:>6}: {kept}/{trials * writers} rows kept, {lossy}/{trials} trials lost rows,"
          f" {extra_headers}/{trials} trials wrote the header more than once")  # fmt: skip
    return {
        "method": method,
        "trials": trials,
        "writers": writers,
        "rows_expected": trials * writers,
        "rows_kept": kept,
        "trials_with_loss": lossy,
    }


def table(path: Path) -> str:
    """The docs table from the CSV: rows kept and trials that lost rows, per method."""
    lines = [
        [
            f"{row['method']} ({'old: no lock' if row['method'] == 'naive' else 'append_row: file lock'})",
            f"{row['trials']} × {row['writers']}",
            f"{row['rows_kept']} / {row['rows_expected']}",
            row["trials_with_loss"],
        ]
        for row in read_rows(path)
    ]
    return markdown_table(["results_csv append", "trials × writers", "rows kept", "trials that lost rows"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table, trials=20, writers=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(method, args.trials, args.writers, Path(folder)) for method in ("naive", "locked")]
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
