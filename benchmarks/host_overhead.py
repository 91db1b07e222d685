"""What checkpointing costs the host: narrow models on tiny tensors, as a GPU's host-bound step sees them.

Each mode of ours and PyTorch's own ``torch.utils.checkpoint`` (the anchor: non-reentrant, its defaults)
wrap every block of a 16-bottleneck CNN with batch norm and of a 12-block pre-norm transformer; a
training step of each variant is timed on one thread, interleaved round by round, the fastest round
kept. The arithmetic of these tensors is negligible, so the ratios are the host's work (Python,
autograd, dispatch, hooks), which is the same beside a GPU. On an H200 the same kind of run gave
what the GPU measured at reduced sizes (r50 batch 32: selective 3.50×, full 2.81×).

Targets (issue 38): full within 5 % of torch's; selective no slower than full (within the 5 % that two runs of
the same work differ by here: on these tensors selective recomputes in full once its first calls showed that keeping
the matmuls does not pay; ``selective kept`` keeps them anyway, the cost of the mode itself). ``--check`` exits 1
when one is missed. The last rows are the region costs the planner prices (seconds per forward kernel of a wrapped
block, and in this host's kernel times: ``HOST_REGION_SECONDS`` of lightning_memopt/planner/hardware.py).

    python benchmarks/host_overhead.py            # ~2 minutes on 2 cores
    python benchmarks/host_overhead.py --quick --check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from results import add_table_options, markdown_table, printed_table, read_rows, write_csv

from lightning_memopt.planner.host import NARROW_MODELS, host_costs, host_step_seconds

FULL_OVER_TORCH = 1.05  # full may cost at most this much more than torch.utils.checkpoint
SELECTIVE_OVER_FULL = 1.05  # selective no slower than full, within the noise of two runs of the same work


def measure(rounds: int) -> list[dict]:
    """One row per narrow model and variant, then the planner's region costs."""
    rows = []
    for name in NARROW_MODELS:
        seconds = host_step_seconds(name, rounds)
        for variant, value in seconds.items():
            rows.append(
                {
                    "model": name,
                    "variant": variant,
                    "seconds": f"{value:.6f}",
                    "over_none": f"{value / seconds['none']:.3f}",
                    "over_torch": f"{value / seconds['torch']:.3f}",
                }
            )
    costs = host_costs(rounds=max(2, rounds // 2))
    for mode, (_, per_kernel) in costs.region_seconds.items():
        rows.append(
            {
                "model": "both (4 blocks)",
                "variant": f"{mode}: region per forward kernel",
                "seconds": f"{per_kernel:.6f}",
                "over_none": f"{per_kernel / costs.kernel_seconds:.3f}",  # in host kernel times
                "over_torch": "",
            }
        )
    return rows


def misses(rows: list[dict]) -> list[str]:
    """The targets a run missed, each as a sentence with its numbers."""
    found = []
    for name in NARROW_MODELS:
        ratio = {row["variant"]: float(row["over_none"]) for row in rows if row["model"] == name}
        if ratio["full"] > FULL_OVER_TORCH * ratio["torch"]:
            found.append(
                f"{name}: full {ratio['full']:.2f}× over torch's {ratio['torch']:.2f}× (limit ×{FULL_OVER_TORCH})"
            )
        if ratio["selective"] > SELECTIVE_OVER_FULL * ratio["full"]:
            found.append(
                f"{name}: selective {ratio['selective']:.2f}× is slower than full {ratio['full']:.2f}× "
                f"(limit ×{SELECTIVE_OVER_FULL})"
            )
    return found


def table(path: Path) -> str:
    """The docs table: host time over the step without checkpointing, per model and variant."""
    rows = read_rows(path)
    body = [
        [row["model"], row["variant"], row["over_none"], row["over_torch"] or "—"]
        for row in rows
        if not row["variant"].endswith("per forward kernel")
    ]
    return markdown_table(["narrow model (CPU, host work only)", "variant", "× none", "× torch.utils.checkpoint"], body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 10")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    add_table_options(parser, __file__)
    args = parser.parse_args(argv)
    if printed_table(args, table):
        return 0
    rows = measure(3 if args.quick else 10)
    for row in rows:
        print(f"{row['model']:<18}{row['variant']:<38}× none {row['over_none']:>7}  × torch {row['over_torch']:>6}")
    write_csv(args.csv, rows)
    missed = misses(rows)
    for line in missed:
        print(f"MISSED {line}", file=sys.stderr)
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
