"""Shared by the benchmark scripts: their parser and CSV rows, a quiet CPU Trainer, and the docs tables' pieces."""

from __future__ import annotations

import argparse
import csv
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` (dicts with the same keys) to ``path`` with a header, and say so."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a benchmark CSV, as dicts of strings."""
    with Path(path).open() as handle:
        return list(csv.DictReader(handle))


def add_table_options(parser: argparse.ArgumentParser, script: str) -> None:
    """Give a benchmark's parser ``--csv`` (default: the CSV beside ``script``) and ``--table``."""
    parser.add_argument("--csv", default=str(Path(script).with_suffix(".csv")))
    parser.add_argument("--table", action="store_true", help="print the docs table from the CSV and stop")


class TableParser(argparse.ArgumentParser):
    """A benchmark's parser: the first paragraph of its docstring ``doc`` as the description, the table options
    (:func:`add_table_options`) and ``numbers``, options of a number each (``rounds=2``: ``--rounds``, an int, 2
    by default). With ``--table`` it prints ``table(csv)`` (the docs table) and exits, as ``--help`` does.

    Args:
        doc: the script's docstring.
        script: the script's path (``__file__``): the CSV beside it is ``--csv``'s default.
        table: the script's docs table from its CSV.
        numbers: more options, each by its name and its default (whose type the option takes).

    Example::

        >>> parser = TableParser("A benchmark.", "claims/x.py", lambda path: f"| {path.name} |", rounds=2)
        >>> parser.parse_args(["--rounds", "3"]).rounds
        3
        >>> parser.parse_args(["--table"])
        Traceback (most recent call last):
        ...
        SystemExit: 0
    """

    def __init__(self, doc: str | None, script: str, table: Callable[[Path], str], **numbers: float) -> None:
        super().__init__(description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
        self.table = table
        add_table_options(self, script)
        for name, default in numbers.items():
            self.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        if parsed.table:
            print(self.table(Path(parsed.csv)))
            self.exit()
        return parsed


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    """A docs table: a header of ``columns`` and one line per row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_trainer(steps: int, callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    """A Trainer for ``steps`` steps without logger, checkpoints, progress bar or summary; on the CPU unless
    ``options`` name another ``accelerator``."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{"accelerator": "cpu", **quiet, **options}, max_steps=steps, callbacks=callbacks)


class StepTimes(pl.Callback):
    """Wall seconds of every training batch."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def prose(*paragraphs: str, width: int = 115) -> str:
    """Generated Markdown prose: each paragraph (a bullet where it starts with ``- ``) wrapped to ``width``."""
    return "\n".join(
        textwrap.fill(
            text,
            width,
            subsequent_indent="  " if text.startswith("- ") else "",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for text in paragraphs
    )


def models_by_variant(rows: list[dict[str, str]]) -> str:
    """``cotracker2, cotracker3 at bf16-mixed, checkpointing preset``: each variant's models (a case's first word)."""
    models: dict[str, list[str]] = {}
    for row in rows:
        models.setdefault(row["variant"], []).append(row["case"].split()[0])
    return "; ".join(f"{', '.join(names)} at {variant}" for variant, names in models.items())


def signed(value: float, digits: int = 1) -> str:
    """``value`` with its sign, a typographic minus: ``−2.1``, ``+3.4``."""
    return f"{value:+.{digits}f}".replace("-", "−")


@dataclass(frozen=True)
class Spread:
    """Predictions against what was measured: each relative deviation (predicted / measured − 1)."""

    deviations: tuple[float, ...]
    tolerance: float = 0.05

    @property
    def within(self) -> int:
        return sum(abs(deviation) <= self.tolerance for deviation in self.deviations)

    @property
    def under(self) -> int:
        return sum(deviation < 0 for deviation in self.deviations)

    def range(self) -> str:
        """The least and the largest deviation, in per cent: ``−2.1 … +3.4%``."""
        return f"{signed(100 * min(self.deviations))} … {signed(100 * max(self.deviations))}%"

    def of(self) -> str:
        """How many are within the tolerance: ``45 of 48``, or ``all 18``."""
        total = len(self.deviations)
        return f"all {total}" if self.within == total else f"{self.within} of {total}"
