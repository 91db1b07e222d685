"""The compiled plan (``plan_compiled``) against the eager plan (``plan_checkpointing``) at one memory limit.

    python benchmarks/claims/compiled_plan.py [--only r50,vit_small] [--budgets 0.2,0.4,0.6,0.8] [--rounds 3]
    python benchmarks/claims/compiled_plan.py --table      # print the docs table from the CSV

The models and the instrument are ``compile_budget.py``'s (fp32, train mode, CPU; the CPU allocator's peak of one
forward and backward above the weights and the batch), but the gradients are not allocated up front: each step
starts with ``.grad`` set to None, as Lightning's ``zero_grad`` leaves it, so both sides' peaks hold the gradients
made in the backward. For each model the plain eager step is measured first; its peak ``P`` sets the limits. At
each budget ``b`` the limit is ``b × P``, and:

- **eager plan**: the checkpointing ``plan_checkpointing(model, batch, b)`` picks (per block full / selective /
  offload or kept), run eagerly;
- **compiled plan**: ``plan_compiled(model, batch, loss, b × P)``: the largest ``activation_memory_budget`` of
  1, 0.8, …, 0 whose predicted peak fits, compiled with inductor at that budget.

Both are timed side by side in interleaved rounds (fastest step each), then their peaks measured. "fits" is the
prediction's verdict, "within" the measured peak's.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, prose, read_rows, write_csv
from claims.compile_budget import (  # the models and the instrument
    CASES,
    _modes_label,
    _square_mean,
    allocator_peak,
    compiled_variant,
    our_variant,
    time_rounds,
)

from lightning_memopt.planner.compiled_plan import plan_compiled

_MIB = 2**20
BUDGETS = (0.2, 0.4, 0.6, 0.8)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _square_mean(model(*batch))


def measure(key: str, budgets: tuple[float, ...], rounds: int) -> list[dict[str, Any]]:
    case = CASES[key]
    build, batch = case.build, case.batch()
    plain, _ = our_variant(build, batch, 1.0)
    plain.step(batch)
    plain.model.zero_grad(set_to_none=True)
    reference = allocator_peak(lambda: plain.forward(batch)).peak
    rows = []
    for budget in budgets:
        torch._dynamo.reset()
        limit = int(budget * reference)
        eager, eager_plan = our_variant(build, batch, budget)
        choice = plan_compiled(build, batch, _loss, limit)
        compiled = compiled_variant(build, batch, "inductor", choice.budget)
        time_rounds([eager, compiled], batch, rounds)
        for variant in (eager, compiled):
            variant.model.zero_grad(set_to_none=True)  # as Lightning's optimizer step leaves them
        peaks = {v.name: allocator_peak(lambda v=v: v.forward(batch)).peak for v in (eager, compiled)}
        row = {
            "model": case.name,
            "budget": budget,
            "limit_mib": limit / _MIB,
            "eager_modes": _modes_label(eager_plan.modes),
            "eager_peak_mib": peaks["ours"] / _MIB,
            "eager_seconds": min(eager.seconds),
            "compile_budget": choice.budget,
            "compiled_fits": choice.fits,
            "compiled_predicted_mib": choice.predicted.peak_bytes / _MIB,
            "compiled_peak_mib": peaks[compiled.name] / _MIB,
            "compiled_seconds": min(compiled.seconds),
            "compile_seconds": compiled.compile_seconds,
            "compiled_within": peaks[compiled.name] <= limit,
            "compiled_vs_eager_time": min(compiled.seconds) / min(eager.seconds),
        }
        print(row, flush=True)
        rows.append(row)
        del eager, compiled
        gc.collect()
    torch._dynamo.reset()
    return rows


def table(path: Path) -> str:
    """Per model and budget: the limit, each plan's measured peak and step time, the compiled plan's budget and
    prediction, and compiled time over eager."""
    cells, previous = [], None
    for row in read_rows(path):
        model = row["model"].split(" (")[0]
        within = row["compiled_within"] == "True"
        fits = row["compiled_fits"] == "True"
        compiled_peak = f"{float(row['compiled_peak_mib']):.1f}" + ("" if within else " (over)")
        cells.append(
            [
                model if model != previous else "",
                f"{float(row['budget']):g}",
                f"{float(row['limit_mib']):.1f}",
                f"{row['eager_modes']}: {float(row['eager_peak_mib']):.1f}"
                + (" (over)" if float(row["eager_peak_mib"]) > float(row["limit_mib"]) else ""),
                f"{float(row['compile_budget']):g}" + ("" if fits else " (none fits)"),
                f"{float(row['compiled_predicted_mib']):.1f}",
                compiled_peak,
                f"{float(row['compile_seconds']):.0f}",
                f"{float(row['compiled_vs_eager_time']):.2f}",
            ]
        )
        previous = model
    columns = [
        "model",
        "budget",
        "limit MiB",
        "eager plan: blocks, peak MiB",
        "compile budget chosen",
        "predicted MiB",
        "compiled peak MiB",
        "compile s",
        "time compiled ÷ eager",
    ]
    return markdown_table(columns, cells)


def targets(path: Path) -> str:
    """Whether each fitting compiled plan stayed within its limit, and on how many models it was no slower."""
    rows = read_rows(path)
    fitting = [row for row in rows if row["compiled_fits"] == "True"]
    over = [
        f"{row['model'].split(' (')[0]} at {float(row['budget']):g}"
        for row in fitting
        if row["compiled_within"] != "True"
    ]
    by_model: dict[str, list[float]] = {}
    for row in fitting:
        by_model.setdefault(row["model"].split(" (")[0], []).append(float(row["compiled_vs_eager_time"]))
    faster = [model for model, ratios in by_model.items() if all(ratio <= 1.0 for ratio in ratios)]
    return prose(
        f"- The compiled plan fits by its prediction at {len(fitting)} of {len(rows)} limits; measured within the "
        f"limit at {len(fitting) - len(over)} of those" + (f" (over: {', '.join(over)})." if over else "."),
        f"- No slower than the eager plan at every limit where it fits: {len(faster)} of {len(by_model)} models"
        + (f" ({', '.join(faster)})." if faster else "."),
    )


def main() -> None:
    parser = TableParser(__doc__, __file__, table, rounds=3)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="fractions of the plain peak")
    args = parser.parse_args()
    budgets = tuple(float(part) for part in args.budgets.split(","))
    rows = [row for key in args.only.split(",") for row in measure(key, budgets, args.rounds)]
    write_csv(Path(args.csv), rows)
    print(table(Path(args.csv)))
    print(targets(Path(args.csv)))


if __name__ == "__main__":
    main()
