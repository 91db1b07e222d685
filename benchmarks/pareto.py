"""The Pareto table and chart of a ``memory_grid`` sweep: which knob settings trade memory for speed best.

    memopt-train sweep=memory_grid model=sapiens_tiny model.warmup_steps=1 data=synthetic_normals \\
      'data.image_size=[64,48]' data.batch_size=4
    python benchmarks/pareto.py logs/train/multiruns/<time>/memory_grid.csv [--png pareto.png] [--budget-mib 12]

Prints every run by increasing peak memory with its throughput, marks the runs on the front (no
other run is as fast with as little memory) and, given a budget, the fastest run that fits it.
"""

from __future__ import annotations

import argparse

# a sibling module: run from benchmarks/ or as a path
from pareto_front import fastest_within, labels, read_sweep, table, write_chart

_MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the sweep's memory_grid.csv")
    parser.add_argument("--png", default=None, help="write the chart here")
    parser.add_argument("--budget-mib", type=float, default=None, help="mark what fits this budget")
    args = parser.parse_args()
    runs = read_sweep(args.csv)
    if not runs:
        raise SystemExit(f"pareto: {args.csv} holds no finished run")
    budget = int(args.budget_mib * _MIB) if args.budget_mib else None
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
