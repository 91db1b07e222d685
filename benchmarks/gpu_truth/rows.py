"""gpu_truth.py's rows: one CSV schema for every section, and the markdown tables made from the CSV.

Example::

    >>> line = row("step time", "r50 b32 112²", "full", seconds=0.25, ratio=1.31)
    >>> line["section"], line["ratio"], line["passed"]
    ('step time', 1.31, '')
    >>> print(markdown([line]).splitlines()[4])
    | r50 b32 112² | full | 0.2500 | 1.310 |
"""

from __future__ import annotations

import math
from typing import Any

from bench import markdown_table

from .device import Peak

COLUMNS = (
    "section",
    "case",
    "variant",
    "predicted_mib",
    "allocated_mib",
    "reserved_mib",
    "deviation",
    "seconds",
    "ratio",
    "predicted_ratio",
    "passed",
    "note",
)
FIGURES = COLUMNS[3:-2]  # the numbers a row may hold (NaN where its section measures none)
_HEADERS = {
    "case": "case",
    "variant": "variant",
    "predicted_mib": "predicted MiB",
    "allocated_mib": "allocated MiB",
    "reserved_mib": "reserved MiB",
    "deviation": "predicted / allocated",
    "seconds": "seconds",
    "ratio": "ratio",
    "predicted_ratio": "planner's ratio",
    "passed": "passed",
    "note": "note",
}
_MIB = 2**20


def row(
    section: str,
    case: str,
    variant: str,
    *,
    predicted: int | None = None,
    peak: Peak | None = None,
    deviation: float = math.nan,
    seconds: float = math.nan,
    ratio: float = math.nan,
    predicted_ratio: float = math.nan,
    passed: bool | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One CSV row; what a section does not measure stays NaN (numbers) or empty (``passed``: not a check)."""
    return {
        "section": section,
        "case": case,
        "variant": variant,
        "predicted_mib": predicted / _MIB if predicted is not None else math.nan,
        "allocated_mib": peak.allocated / _MIB if peak is not None else math.nan,
        "reserved_mib": peak.reserved / _MIB if peak is not None else math.nan,
        "deviation": deviation,
        "seconds": seconds,
        "ratio": ratio,
        "predicted_ratio": predicted_ratio,
        "passed": "" if passed is None else ("yes" if passed else "no"),
        "note": note,
    }


def failed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose check failed."""
    return [line for line in rows if line["passed"] == "no"]


def _cell(column: str, value: Any) -> str:
    if column in ("case", "variant", "passed", "note"):
        return str(value)
    number = float(value)
    if math.isnan(number):
        return "–"
    if column == "deviation":
        return f"{number + 1:.3f}"
    if column == "seconds":
        return f"{number:.4f}"
    return f"{number:.3f}" if column in ("ratio", "predicted_ratio") else f"{number:.1f}"


def _shown(column: str, rows: list[dict[str, Any]]) -> bool:
    if column in ("case", "variant"):
        return True
    if column in ("passed", "note"):
        return any(str(line[column]) for line in rows)
    return any(not math.isnan(float(line[column])) for line in rows)


def markdown(rows: list[dict[str, Any]]) -> str:
    """A table per section (rows read from the CSV or fresh), each with the columns its rows fill."""
    tables = []
    for section in dict.fromkeys(line["section"] for line in rows):
        lines = [line for line in rows if line["section"] == section]
        columns = [column for column in _HEADERS if _shown(column, lines)]
        body = [[_cell(column, line[column]) for column in columns] for line in lines]
        table = markdown_table([_HEADERS[column] for column in columns], body)
        tables.append(f"**{section}**\n\n{table}")
    return "\n\n".join(tables)
