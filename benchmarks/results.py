"""Shared by the benchmark scripts: write the measured rows to a CSV file."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` (dicts with the same keys) to ``path`` with a header, and say so."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
