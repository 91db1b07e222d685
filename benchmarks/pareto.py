"""The Pareto table and chart of a ``memory_grid`` sweep: which knob settings trade memory for speed best.

    memopt-train sweep=memory_grid model=sapiens_tiny model.warmup_steps=1 data=synthetic_normals \\
      'data.image_size=[64,48]' data.batch_size=4
    python benchmarks/pareto.py logs/train/multiruns/<time>/memory_grid.csv [--png pareto.png] [--budget-mib 12]

Prints every run by increasing peak memory with its throughput, marks the runs on the front (no
other run is as fast with as little memory) and, given a budget, the fastest run that fits it.
A run is on the front when no other run is at least as fast with no more memory (and strictly
better in one of the two). ``memopt-train sweep=memory_grid`` writes the CSV these functions read;
``claims/plan_vs_sweep.py`` imports them.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_memopt.memory.report import chart
from lightning_memopt.vocabulary import MIB

# the memory_budget knobs prefix, left out of the labels
KNOB_PREFIX = "memopt.callbacks.memory_budget.knobs."


@dataclass(frozen=True)
class SweepRun:
    """One run of the sweep: its overrides, peak memory and throughput."""

    overrides: tuple[str, ...]
    peak_bytes: int
    samples_per_second: float

    def knobs(self) -> dict[str, str]:
        """The ``memory_budget`` knobs this run set (name → value as written)."""
        pairs = (o.partition("=") for o in self.overrides if o.startswith(KNOB_PREFIX))
        return {key[len(KNOB_PREFIX) :]: value for key, _, value in pairs}


def read_sweep(path: str | Path) -> list[SweepRun]:
    """The runs in a CSV written by ``memopt-train ... results_csv=PATH`` (the ``memory_grid`` sweep).

    Raises:
        ValueError: a file without the columns ``label``, ``peak_memory_bytes``, ``samples_per_second``.
    """
    with Path(path).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    needed = {"label", "peak_memory_bytes", "samples_per_second"}
    if rows and not needed <= set(rows[0]):
        raise ValueError(f"`path`={str(path)!r} lacks the columns {sorted(needed - set(rows[0]))}")
    return [
        SweepRun(tuple(row["label"].split()), int(row["peak_memory_bytes"]), float(row["samples_per_second"]))
        for row in rows
        if row["peak_memory_bytes"]
    ]


def pareto_front(runs: Sequence[SweepRun]) -> list[SweepRun]:
    """The runs no other run beats on both memory and speed, by increasing memory.

    Example::

        >>> runs = [SweepRun(("a",), 10, 5.0), SweepRun(("b",), 20, 4.0), SweepRun(("c",), 30, 9.0)]
        >>> [run.overrides[0] for run in pareto_front(runs)]
        ['a', 'c']
    """
    front: list[SweepRun] = []
    for run in sorted(runs, key=lambda r: (r.peak_bytes, -r.samples_per_second)):
        if not front or run.samples_per_second > front[-1].samples_per_second:
            front.append(run)
    return front


def fastest_within(runs: Sequence[SweepRun], budget_bytes: int) -> SweepRun | None:
    """The fastest run whose peak is at most ``budget_bytes`` (``None`` if none is)."""
    fitting = [run for run in runs if run.peak_bytes <= budget_bytes]
    return max(fitting, key=lambda run: run.samples_per_second, default=None)


def labels(runs: Sequence[SweepRun]) -> list[str]:
    """Short labels: the overrides not shared by every run, knob names without their prefix."""
    if not runs:
        return []
    shared = set.intersection(*(set(run.overrides) for run in runs))
    return [" ".join(o.removeprefix(KNOB_PREFIX) for o in run.overrides if o not in shared) or "(base)" for run in runs]


def table(runs: Sequence[SweepRun], budget_bytes: int | None = None) -> str:
    """Every run by increasing peak: MiB, samples/s, whether it is on the front (and fits ``budget_bytes``)."""
    ordered = sorted(runs, key=lambda r: (r.peak_bytes, -r.samples_per_second))
    front = set(pareto_front(runs))
    names = labels(ordered)
    width = max((len(name) for name in names), default=10)
    header = f"{'configuration':<{width}}  {'peak MiB':>9}  {'samples/s':>9}  front" + (
        "  fits" if budget_bytes else ""
    )
    lines = [header]
    for run, name in zip(ordered, names, strict=True):
        line = f"{name:<{width}}  {run.peak_bytes / MIB:>9.2f}  {run.samples_per_second:>9.2f}  "
        line += f"{'yes' if run in front else '':<5}"
        if budget_bytes:
            line += f"  {'yes' if run.peak_bytes <= budget_bytes else 'no'}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def write_chart(runs: Sequence[SweepRun], path: str | Path, budget_bytes: int | None = None) -> None:
    """Scatter of throughput against peak memory, the front joined, the budget as a vertical line (matplotlib)."""
    with chart(path, (8, 5), dpi=120) as axes:
        axes.scatter([r.peak_bytes / MIB for r in runs], [r.samples_per_second for r in runs], color="0.6")
        front = pareto_front(runs)
        names = dict(zip(runs, labels(runs), strict=True))
        axes.plot([r.peak_bytes / MIB for r in front], [r.samples_per_second for r in front], "o-", color="C0")
        for run in front:
            axes.annotate(names[run], (run.peak_bytes / MIB, run.samples_per_second), fontsize=7, rotation=15)
        if budget_bytes:
            axes.axvline(budget_bytes / MIB, color="C3", linestyle="--", label="budget")
            axes.legend()
        axes.set_xlabel("peak memory (MiB)")
        axes.set_ylabel("samples / s")
        axes.set_title("memory_grid: the Pareto front")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the sweep's memory_grid.csv")
    parser.add_argument("--png", default=None, help="write the chart here")
    parser.add_argument("--budget-mib", type=float, default=None, help="mark what fits this budget")
    args = parser.parse_args()
    runs = read_sweep(args.csv)
    if not runs:
        raise SystemExit(f"pareto: {args.csv} holds no finished run")
    budget = int(args.budget_mib * MIB) if args.budget_mib else None
    print(table(runs, budget))
    if budget is not None:
        best = fastest_within(runs, budget)
        names = dict(zip(runs, labels(runs), strict=True))
        print(f"fastest within {args.budget_mib} MiB: " + ("none fits" if best is None else names[best]))
    if args.png:
        write_chart(runs, args.png, budget)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
