"""GPU truth: every memory and time claim re-measured on a CUDA device, in one command.

    python benchmarks/gpu_truth.py            # every preset (target: ≤ 10 min on one H100) → gpu_truth.csv
    python benchmarks/gpu_truth.py --quick    # one preset per family → gpu_truth_quick.csv / .md
    python benchmarks/gpu_truth.py --dry-run  # the tiny presets on the CPU: the same code path (what CI runs)
    python benchmarks/gpu_truth.py --table [--csv benchmarks/gpu_truth/gpu_truth.csv]   # the markdown from a CSV
    python benchmarks/gpu_truth.py --deadline 480  # no section starts after 8 minutes (a device lent for minutes)

Sections, in the order they run (the most important first; one CSV and one markdown table per section, the device
and its driver in the first row; both files are rewritten after each section):

- step time: forward + backward under none / selective / full / offload, and bf16-mixed against 32-true,
  beside the planner's predicted ratio; at the sizes that keep the GPU busy, issue 38's targets are checked (full
  ≤ 1.38×, selective ≤ 1.10× and no slower than full, offload ≤ 1.15 × the larger of the unchecked step and the
  offloaded bytes over the host link's measured rate out plus in).
- host: the narrow models of ``lightning_memopt.planner.host`` (tiny kernels: the host sets the step's time) on
  this device and on this machine's CPU, each mode over none, beside the ratio the planner prices; and this CPU's
  Python work per wrapped block over the catalogue's (measured on the CI machine): how fast this GPU's host is.
- monitor: MemoryMonitor's allocator figures, and a fit's time with it over without.
- oom recovery: a device capped between the whole batch's peak and half's; AdaptiveAccumulation must recover
  with the gradients of the whole batch.
- overflow: PrecisionSwitch 16-mixed with an inf gradient injected: the scaler skips the step, halves the scale.
- prediction: each preset at a reduced input, fp32 and bf16-mixed, with and without its blocks
  checkpointed: the fake-mode peak (nothing allocated, computed in worker processes) against
  ``torch.cuda.max_memory_allocated``, beside ``max_memory_reserved``. A prediction more than 5% off fails.
- reference batch: the README's memory table (every preset at its reference batch, ``memory_profile.py``)
  predicted for this device against two real training steps; more than 5% off fails (needs hydra-core).
- smallest device: for r50, sapiens_0.3b and cotracker3 (unchecked fp32, checkpointed bf16-mixed), the least
  memory the step runs on (bisected with the device capped), and the safety margin its prediction needs there.
- calibration: the least planner ``safety_margin`` covering every smallest-device row whose prediction holds
  (a prediction more than 5 % off fails its own row); it fails above the planner's default.
- seeds: the runs users could not fit (CoTracker2 on Kubric-size clips on a 24 GB RTX 3090, Sapiens-2B at
  1024×768 on an 80 GB A800, r100 with TopoFR's loss at batch 32 on a 32 GB V100), planned for that GPU and
  run on this device capped to its memory (see ``gpu_truth/seeds.py``).
- allocator: reserved over allocated for r50's step, with PyTorch's default allocator and with expandable segments
  (``memopt-train``'s default), each in a fresh process.
- planner: MemoryBudget plans for a device of the model states and half the rest of the case's unchecked
  fp32 peak; the fit runs on the device capped there (``set_per_process_memory_fraction``): the chosen
  knobs, the predicted and the real peak.
- cuda tests: ``pytest -m cuda`` over the project's tests.

It exits with 1 when any check fails (a prediction more than 5% off included), after writing everything.
On a CPU it runs ``--dry-run`` only: the tiny presets, the tracker for the allocator and a
``SimulatedDevice`` for the capped device. How to recalibrate the planner from the CSV: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import date
from multiprocessing.pool import AsyncResult
from pathlib import Path

from bench import Spread, models_by_variant, prose, read_rows, write_csv

from .allocator import allocator_rows
from .cases import SUITES
from .device import TruthDevice
from .host import host_rows
from .memory import PREDICTION_TOLERANCE, margin_row, planned_row, prediction_rows, smallest_device_rows
from .recovery import cuda_tests_row, overflow_row, recovery_row
from .reference import reference_rows
from .rows import FIGURES, failed, markdown, row
from .runtime import monitor_rows, step_time_rows
from .seeds import SEEDS, planned_knobs, runs_here, seed_row

_HERE = Path(__file__).resolve().parent


def device_row(device: TruthDevice, suite: str) -> dict:
    """The first row: what the truth was measured on, when, and with which suite."""
    return row(
        "device",
        device.name,
        device.driver,
        note=f"{device.total_bytes / 2**30:.1f} GiB; CUDA context {device.context_bytes / 2**20:.0f} MiB; "
        f"suite {suite}; {date.today().isoformat()}",
    )


def run_section(name: str, produce: Callable[[], list[dict]]) -> list[dict]:
    """A section's rows, printed; a section that raises is one failed row with its error (the run goes on: a GPU
    session keeps what the other sections measured), its traceback printed."""
    started = time.perf_counter()
    try:
        produced = produce()
    except Exception as error:  # noqa: BLE001 — any failure of a section is a finding, written as a row
        traceback.print_exc()
        produced = [row(name, "the section failed", type(error).__name__, passed=False, note=str(error).split("\n")[0])]
    for line in produced:
        flag = {"yes": "ok  ", "no": "FAIL"}.get(line["passed"], "    ")
        figures = ", ".join(f"{key} {float(line[key]):.4g}" for key in FIGURES if not math.isnan(float(line[key])))
        print(f"{flag} {name:<13}{line['case']:<30}{line['variant']:<40}{figures}  {line['note']}", flush=True)
    print(f"     {name}: {time.perf_counter() - started:.0f} s", flush=True)
    return produced


def measure(
    device: TruthDevice,
    suite_name: str,
    workers: int,
    deadline: float = math.inf,
    keep: Callable[[list[dict]], None] = lambda rows: None,
) -> list[dict]:
    """Every section's rows, printed as each section ends and handed to ``keep`` (the run writes its CSV there, so a
    run stopped from outside leaves what it measured). A section that would start more than ``deadline`` seconds
    after the first is not run: one row says so. The order is the order of importance: the timings first (no
    worker process beside them), then the memory sections while workers make the seeds' plans."""
    suite, seeds = SUITES[suite_name], SEEDS[suite_name]
    rows = [device_row(device, suite_name)]
    started = time.perf_counter()

    def section(name: str, produce: Callable[[], list[dict]]) -> None:
        elapsed = time.perf_counter() - started
        if elapsed > deadline:
            rows.append(row(name, "not measured", "past --deadline", note=f"{elapsed:.0f} s > --deadline {deadline:g}"))
            print(f"skip {name}: {elapsed:.0f} s passed, --deadline {deadline:g} s", flush=True)
        else:
            rows.extend(run_section(name, produce))
        keep(rows)

    section(
        "step time",
        lambda: [
            r
            for case in suite.timings
            for r in step_time_rows(device, case, suite.rounds, targeted=case in suite.speed_targets)
        ],
    )
    section("host", lambda: host_rows(device, suite.rounds))
    section("monitor", lambda: monitor_rows(device, suite.monitor, suite.monitor_steps, suite.rounds))
    section("oom recovery", lambda: [recovery_row(device, suite.recovery)])
    section("overflow", lambda: [overflow_row(device, suite.overflow)])
    # the seeds' plans take minutes of fake-mode profiles on the CPU: made in workers while the device measures
    # the memory sections (after the timings, whose host work they would skew)
    # a pool that can be stopped: a run past its deadline must not wait minutes for plans it will not use
    planners = multiprocessing.get_context("spawn").Pool(max(1, len(seeds)))
    try:
        plans = {
            i: planners.apply_async(planned_knobs, (suite_name, i, device.is_cuda))
            for i, seed in enumerate(seeds)
            if runs_here(device, seed)
        }
        unchecked: dict[str, tuple[int, int]] = {}

        def predictions() -> list[dict]:
            produced, peaks = prediction_rows(device, suite_name, workers)
            unchecked.update(peaks)
            return produced

        section("prediction", predictions)
        section("reference batch", lambda: reference_rows(device, suite_name, workers))
        section(
            "smallest device",
            lambda: smallest_device_rows(device, suite_name, [r for r in rows if r["section"] == "prediction"]),
        )
        section(
            "calibration",
            lambda: [
                margin_row(*([r for r in rows if r["section"] == name] for name in ("smallest device", "prediction")))
            ],
        )
        section("seeds", lambda: [seed_row(device, seed, _plan_or_error(plans.get(i))) for i, seed in enumerate(seeds)])
    finally:
        planners.terminate()
    section("allocator", lambda: allocator_rows(device, suite_name))
    section("planner", lambda: [planned_row(device, case, unchecked[case.name]) for case in suite.planning])
    section("cuda tests", lambda: [cuda_tests_row(device)])
    return rows


def _plan_or_error(future: AsyncResult | None) -> tuple | None:
    """A seed's plan from its worker (None for a seed this device cannot run), or no knobs and the worker's error
    (the seed row then says it)."""
    if future is None:
        return None
    try:
        return future.get()
    except Exception as error:  # noqa: BLE001 — a plan that fails is a finding of its row
        return None, 0, f"planning failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def document(rows: list[dict]) -> str:
    """The markdown: the device line, then a table per section."""
    first = rows[0]
    heading = f"Measured on {first['case']} ({first['variant']}; {first['note']})."
    return heading + "\n\n" + markdown(rows[1:])


def table(path: Path) -> str:
    """The markdown of a CSV this script wrote (``benchmarks/tables.py`` renders the docs' copy with it)."""
    return document(read_rows(path))


def summary(path: Path) -> str:
    """The docs' figures of a run: its predictions against the allocator, the capped fits, the safety margin the
    smallest devices need, the allocator's and the monitor's ratios."""
    rows = read_rows(path)
    section = {name: [line for line in rows if line["section"] == name] for name in {line["section"] for line in rows}}

    def spread(lines: list[dict]) -> Spread:
        return Spread(tuple(float(line["deviation"]) for line in lines), PREDICTION_TOLERANCE)

    def ratios(name: str) -> str:
        return "; ".join(f"{float(line['ratio']):.3f} with {line['variant']}" for line in section[name])

    predicted, reference = spread(section["prediction"]), spread(section["reference batch"])
    missed = [line for line in section["prediction"] if line["passed"] == "no"]
    fits = [line for line in section["planner"] + section["seeds"] if line["passed"] == "yes"]
    peaks = ", ".join(f"{float(line['deviation']) + 1:.3f} ({line['case'].split()[0]})" for line in fits)
    margins = [float(line["ratio"]) for line in section["smallest device"]]
    (calibration,) = section["calibration"]
    verdict = "passed" if calibration["passed"] == "yes" else "failed"
    return prose(
        f"- **Memory predictions against `max_memory_allocated`:** {predicted.of()} reduced-size rows within "
        f"{PREDICTION_TOLERANCE:.0%} ({predicted.range()}, {predicted.under} under); missed: "
        f"{models_by_variant(missed)} ({spread(missed).range()}). The README's reference batches: "
        f"**{reference.of()} within {PREDICTION_TOLERANCE:.0%}, {reference.range()}**.",
        f"- **Capped fits (the planner's, the seeds'):** {len(fits)} ran without running out of memory, predicted at "
        f"{peaks} of their real peaks.",
        f"- **Safety margin:** the smallest capped device each case ran on needs m = {min(margins):.3f}–"
        f"{max(margins):.3f}; the calibration row, {float(calibration['ratio']):.3f}, {verdict} against "
        f"{calibration['note'].split('; ')[-1]}.",
        f"- **Allocator**, reserved over allocated: {ratios('allocator')}.",
        f"- **MemoryMonitor**, the fit's time with it over without: {ratios('monitor')}.",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--quick", action="store_true", help="one preset per family (fewer rows; not yet timed on a GPU)"
    )
    which.add_argument("--dry-run", action="store_true", help="the tiny presets on the CPU, as CI runs it")
    parser.add_argument("--csv", type=Path, help="where to write (default: benchmarks/gpu_truth/gpu_truth[_quick].csv; "
                        "a temporary folder for --dry-run); the markdown goes beside it (.md)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="processes computing the fake-mode predictions")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=math.inf,
                        help="seconds after which no further section starts (each one left out is a row that says "
                        "so): a device lent for minutes keeps what the most important sections measured")  # fmt: skip
    parser.add_argument("--table", action="store_true", help="print the markdown of --csv and stop")
    args = parser.parse_args()
    suite = "dry" if args.dry_run else "quick" if args.quick else "full"
    name = {"dry": "gpu_truth_dry_run.csv", "quick": "gpu_truth_quick.csv", "full": "gpu_truth.csv"}[suite]
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be at least 1")
    if not args.deadline > 0:
        parser.error(f"--deadline={args.deadline:g} must be a positive number of seconds")
    if args.table:
        shown = args.csv or _HERE / name
        if not shown.is_file():
            parser.error(f"--table: no CSV at {shown}; give --csv the one a run wrote")
        print(table(shown))
        return 0
    device = TruthDevice.detect(prefer_cuda=not args.dry_run)
    if not device.is_cuda and not args.dry_run:
        parser.error("no CUDA device here: run it on a GPU machine, or check the code path with --dry-run")
    csv_path = args.csv or (Path(tempfile.mkdtemp(prefix="gpu_truth_")) if args.dry_run else _HERE) / name
    print(f"gpu_truth ({suite}) on {device.describe()}", flush=True)
    markdown_path = csv_path.with_suffix(".md")
    csv_path.parent.mkdir(parents=True, exist_ok=True)

    def keep(rows: list[dict]) -> None:
        write_csv(csv_path, rows)
        markdown_path.write_text(document(rows) + "\n")

    rows = measure(device, suite, args.workers, args.deadline, keep)  # written after each section
    print(f"wrote {markdown_path}")
    failures = failed(rows)
    for line in failures:
        print(f"FAILED {line['section']}: {line['case']}, {line['variant']}: {line['note']}", file=sys.stderr)
    print(f"{len(failures)} of {sum(1 for line in rows if line['passed'])} checks failed")
    return 1 if failures else 0
