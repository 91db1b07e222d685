"""The planner against an exhaustive ``memory_grid`` sweep on the CPU (issue 11, acceptance b).

    python benchmarks/claims/plan_vs_sweep.py [--budgets-mib 10 9 6 4.5] [--rounds 6] [--steps 8] [--sweep-csv PATH]

1. The sweep: ``memopt-train sweep=memory_grid`` on sapiens_tiny (synthetic normals at 64×48,
   batch 4) over every knob — precision × attention kernel × checkpointing (every mode at every_n
   1 and 2, full at 3 and 4) × micro-batch size — each run's peak counted by the MemoryTracker
   (live tensor bytes of its second batch) and its throughput, kept in memory_grid.csv (skipped
   when ``--sweep-csv`` gives a sweep's file).
2. For each budget, ``plan()`` for a CPU whose memory is the budget (``measure_cpu``: this
   machine's rates), as ``MemoryBudget(budget=..., safety_margin=0)`` plans off CUDA: no safety
   margin, since a SimulatedDevice has no CUDA context or fragmentation to leave room for.
3. The plan's real peak is its run's in the sweep: it must be ≤ the budget and ≥ 70 % of it.
4. Its step time against the fastest configuration that fits the budget: the three fastest fitting
   runs of the sweep and the plan are trained again side by side, interleaved round by round in one
   process; the fastest of them by median steady step is the reference. The target: the plan's
   step time within 10 % of it (ratio ≤ 1.10).

Writes plan_vs_sweep.csv (one row per budget) and prints the Pareto table of the sweep.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

# a sibling script: run from benchmarks/ or as a path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import StepTimes, TableParser, cpu_trainer, markdown_table, prose, read_rows, write_csv
from pareto import SweepRun, fastest_within, read_sweep, table

from lightning_memopt import MemoryBudget
from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.plan_config import first_batch
from lightning_memopt.planner import Knobs, measure_cpu, plan

PEAK_FLOOR = 0.7  # the plan uses at least 70 % of the budget
TIME_TARGET = 1.10  # and steps within 10 % of the fastest configuration that fits
CONTENDERS = 3
GRID_CSV = Path(__file__).with_name("memory_grid.csv")  # the sweep's runs, kept for --sweep-csv
_MIB = 2**20
BASE = [
    "model=sapiens_tiny",
    "model.warmup_steps=1",
    "data=synthetic_normals",
    "data.image_size=[64,48]",
    "data.batch_size=4",
]
_KNOB = "memopt.callbacks.memory_budget.knobs."
_COMMON = [f"{_KNOB}precision=32-true,bf16-mixed", f"{_KNOB}attn_impl=sdpa,math", f"{_KNOB}micro_batch_size=null,2,1"]
# every checkpoint mode at every_n 1 and 2, and full checkpointing of every 3rd and 4th block (the planner's ladder)
GRIDS = [
    [*_COMMON, f"{_KNOB}checkpoint=none,selective,full,offload", f"{_KNOB}every_n=1,2"],
    [*_COMMON, f"{_KNOB}checkpoint=full", f"{_KNOB}every_n=3,4"],
]


def run_sweep(directory: Path) -> Path:
    """The exhaustive sweep, ``memopt-train`` multiruns into one CSV; returns it."""
    path = directory / "memory_grid.csv"
    for index, grid in enumerate(GRIDS):
        command = ["memopt-train", "-m", "sweep=memory_grid", *BASE, *grid, "logger=none"]
        command += [f"hydra.sweep.dir={directory / str(index)}", f"results_csv={path}"]
        print("sweep:", " ".join(command), flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"the sweep failed:\n{result.stderr[-3000:]}")
    return path


def knobs_of(run: SweepRun) -> Knobs:
    values = run.knobs()
    micro = values.get("micro_batch_size", "null")
    return Knobs(
        precision=values.get("precision", "32-true"),
        attn_impl=None if values.get("attn_impl", "null") == "null" else values["attn_impl"],
        checkpoint=values.get("checkpoint", "none"),
        every_n=int(values.get("every_n", 1)),
        micro_batch_size=None if micro == "null" else int(micro),
    )


def same_configuration(a: Knobs, b: Knobs) -> bool:
    """Equal knobs, every_n ignored where nothing is checkpointed."""
    return a == b or (a.checkpoint == b.checkpoint == "none" and Knobs(**{**a.as_dict(), "every_n": b.every_n}) == b)


def step_seconds(cfg, contenders: dict[str, Knobs], rounds: int, steps: int) -> dict[str, float]:
    """Median steady step (steps 1 … N-1 of every round) of each contender, interleaved round by round."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            times = StepTimes()
            trainer = cpu_trainer(steps, [MemoryBudget(knobs=contenders[name].as_dict()), times], limit_val_batches=0)
            torch.manual_seed(0)
            trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))
            seconds[name] += times.seconds[1:]
    return {name: statistics.median(values) for name, values in seconds.items()}


def budget_table(path: Path) -> str:
    """The docs' table from the CSV: per budget, the plan, its real peak's share, its step time against the fastest."""
    lines = []
    for row in read_rows(path):
        share = float(row["peak_share_of_budget"])
        fastest = row["fastest_side_by_side"]
        lines.append(
            [
                f"{float(row['budget_mib']):.1f} MiB",
                row["plan"],
                f"{float(row['predicted_peak_mib']):.2f} / {float(row['real_peak_mib']):.2f} MiB",
                f"**{share:.0%}**" if share < PEAK_FLOOR else f"{share:.0%}",
                "the plan" if fastest == row["plan"] else f"{fastest} ({float(row['fastest_step_ms']):.1f} ms)",
                f"**{float(row['step_time_ratio']):.2f}** ({float(row['plan_step_ms']):.1f} ms)",
            ]
        )
    columns = [
        "budget",
        "plan",
        "predicted / real peak (host copies apart)",
        "share of budget",
        "fastest fitting, side by side",
    ]
    return markdown_table([*columns, "plan ÷ fastest"], lines)


def targets(path: Path) -> str:
    """The docs' targets, each met or missed at each budget, from the CSV."""
    rows = read_rows(path)
    over = [
        f"{float(row['budget_mib']):g} MiB" for row in rows if float(row["real_peak_mib"]) > float(row["budget_mib"])
    ]
    lines = [f"Over its budget: {', '.join(over)}." if over else "Every plan's real peak is within its budget.", ""]
    for name, column, cell, meets in (
        (
            f"real peak ≥ {PEAK_FLOOR:.0%} of the budget",
            "peak_share_of_budget",
            "{:.0%}",
            lambda share: share >= PEAK_FLOOR,
        ),
        (
            f"step time ≤ {TIME_TARGET:.2f} × the fastest fitting",
            "step_time_ratio",
            "{:.2f}",
            lambda ratio: ratio <= TIME_TARGET,
        ),
    ):
        missed = [
            f"{float(row['budget_mib']):g} MiB ({cell.format(float(row[column]))})"
            for row in rows
            if not meets(float(row[column]))
        ]
        verdict = f"; missed at {', '.join(missed)}." if missed else "."
        lines.append(f"- **{name}**: met at {len(rows) - len(missed)} of {len(rows)}{verdict}")
    return prose(*lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, budget_table, rounds=6, steps=8)
    parser.add_argument("--budgets-mib", type=float, nargs="+", default=[10.0, 9.0, 6.0, 4.5])
    parser.add_argument("--sweep-csv", default=None, help="an earlier sweep's memory_grid.csv")
    args = parser.parse_args()
    if args.sweep_csv is None:
        with tempfile.TemporaryDirectory() as scratch:
            shutil.copy(run_sweep(Path(scratch) / "sweep"), GRID_CSV)
        print(f"wrote {GRID_CSV}")
    runs = read_sweep(args.sweep_csv or GRID_CSV)
    print(f"{len(runs)} runs in the sweep\n" + table(runs))
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, "logger=none"])
    batch = first_batch(cfg)
    rows, failures = [], []
    for budget_mib in args.budgets_mib:
        budget = int(budget_mib * _MIB)
        # no safety margin: a SimulatedDevice counts exact bytes, with no CUDA context or fragmentation
        # and no CPU offload: the sweep's runs are single-device ones
        result = plan(
            lambda: instantiate(cfg.model), batch, measure_cpu(budget), safety_margin=0.0, cpu_offload=(False,)
        )
        if result.chosen is None:
            failures.append(f"{budget_mib} MiB: no plan")
            continue
        chosen = result.chosen.knobs
        planned = next((run for run in runs if same_configuration(knobs_of(run), chosen)), None)
        if planned is None:
            raise SystemExit(f"the sweep has no run of the planned {chosen.describe()}")
        fitting = sorted((run for run in runs if run.peak_bytes <= budget), key=lambda r: -r.samples_per_second)
        contenders = {"plan": chosen}
        for run in fitting[:CONTENDERS]:
            if not any(same_configuration(knobs_of(run), knobs) for knobs in contenders.values()):
                contenders[knobs_of(run).describe()] = knobs_of(run)
        times = step_seconds(cfg, contenders, args.rounds, args.steps)
        fastest = min(times, key=times.__getitem__)
        ratio = times["plan"] / times[fastest]
        share = planned.peak_bytes / budget
        print(
            f"budget {budget_mib} MiB: plan {chosen.describe()} (predicted {result.chosen.peak_bytes / _MIB:.2f} MiB, "
            f"real {planned.peak_bytes / _MIB:.2f} MiB = {share:.0%} of the budget); fastest fitting "
            f"{'the plan' if fastest == 'plan' else fastest}; step time plan / fastest = {ratio:.3f}\n  "
            + ", ".join(f"{name}: {seconds * 1000:.1f} ms" for name, seconds in times.items()),
            flush=True,
        )
        if not planned.peak_bytes <= budget or share < PEAK_FLOOR:
            failures.append(f"{budget_mib} MiB: real peak {share:.0%} of the budget")
        if ratio > TIME_TARGET:
            failures.append(f"{budget_mib} MiB: step time {ratio:.3f} × the fastest fitting")
        best_in_sweep = fastest_within(runs, budget)
        rows.append(
            {
                "budget_mib": budget_mib,
                "plan": chosen.describe(),
                "predicted_peak_mib": result.chosen.peak_bytes / _MIB,
                "real_peak_mib": planned.peak_bytes / _MIB,
                "peak_share_of_budget": share,
                "fastest_in_sweep": knobs_of(best_in_sweep).describe() if best_in_sweep else "",
                "fastest_side_by_side": chosen.describe() if fastest == "plan" else fastest,
                "plan_step_ms": times["plan"] * 1000,
                "fastest_step_ms": times[fastest] * 1000,
                "step_time_ratio": ratio,
                "profiles": result.profiles,
            }
        )
    write_csv(args.csv, rows)
    print("targets: real peak ≤ budget and ≥ 70 % of it; step time ≤ 1.10 × the fastest fitting")
    print("not met: " + "; ".join(failures) if failures else "met at every budget")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
