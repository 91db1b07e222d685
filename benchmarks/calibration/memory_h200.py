"""The fake-mode prediction for CUDA against the first CUDA measurements (NVIDIA H200): every measured peak.

``gpu_truth_h200.csv``'s prediction rows hold ``torch.cuda.max_memory_allocated`` of two training steps of
each preset at reduced sizes, fp32 and bf16-mixed, with and without its blocks checkpointed, beside the
prediction of that day (CPU autocast's op lists, tensors only). Each row is predicted again here as the
planner now predicts for the H200: CUDA's autocast lists and its library workspaces
(:mod:`lightning_memopt.memory.workspace`, fitted to these rows). About 10 minutes on two cores.
The checkpointed rows were measured with the checkpointing of that day (``torch.utils.checkpoint``);
their blocks now recompute in backward through our own function, which holds the same tensors.
``reference_batch_peaks_h200.csv`` holds the README's reference-batch peaks measured the same way (two real
steps of each preset at its reference batch); they are predicted again as ``memopt-profile`` now predicts for
the H200 (``gpu_truth/reference.py``).

    python benchmarks/calibration/memory_h200.py [--workers 2]
"""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import (
    Spread,
    TableParser,
    markdown_table,
    models_by_variant,
    prose,
    read_rows,
    write_csv,
)
from gpu_truth.cases import SUITES
from gpu_truth.memory import PREDICTION_TOLERANCE, VARIANTS, _variant, predicted_peak
from gpu_truth.reference import predicted_peak as reference_peak

from lightning_memopt.planner.hardware import gpu
from lightning_memopt.vocabulary import MIB

HERE = Path(__file__).parent


def measured_mib() -> dict[tuple[str, str], tuple[float, float]]:
    """(case, variant) → (the H200's allocated peak, the prediction of that day), MiB."""
    return {
        (row["case"], row["variant"]): (float(row["allocated_mib"]), float(row["predicted_mib"]))
        for row in read_rows(HERE / "gpu_truth_h200.csv")
        if row["section"] == "prediction"
    }


def _predict(job: tuple[int, str, str | None]) -> int:
    index, precision, policy = job
    return predicted_peak("full", index, precision, policy, "cuda", gpu("h200_141gb").workspace)


def _row(case: str, variant: str, allocated: float, then: float, now: float) -> dict:
    """A CSV row (MiB: the H200's allocated peak, the prediction of that day, today's), printed."""
    row = {
        "case": case,
        "variant": variant,
        "allocated_mib": f"{allocated:.1f}",
        "predicted_then_mib": f"{then:.1f}",
        "deviation_then": f"{then / allocated - 1:+.3f}",
        "predicted_now_mib": f"{now:.1f}",
        "deviation_now": f"{now / allocated - 1:+.3f}",
    }
    print(f"{case:<36}{variant:<34}{row['allocated_mib']:>10}{row['deviation_then']:>8}{row['deviation_now']:>8}",
          flush=True)  # fmt: skip
    return row


def measure(workers: int) -> list[dict]:
    """One row per prediction row of the H200 CSV."""
    cases = SUITES["full"].predictions
    jobs = [(index, precision, policy) for index in range(len(cases)) for precision, policy in VARIANTS]
    measured = measured_mib()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return [
            _row(
                cases[index].name,
                _variant(precision, policy),
                *measured[cases[index].name, _variant(precision, policy)],
                peak / MIB,
            )  # fmt: skip
            for (index, precision, policy), peak in zip(jobs, pool.map(_predict, jobs), strict=True)
        ]


def _reference(job: tuple[str, str]) -> int:
    return reference_peak("full", *job, "h200_141gb")


def reference_rows(workers: int) -> list[dict]:
    """One row per reference-batch peak the H200 measured."""
    measured = read_rows(HERE / "reference_batch_peaks_h200.csv")
    jobs = [(row["preset"], row["precision"]) for row in measured]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return [
            _row(
                f"{line['preset']} reference batch",
                line["precision"],
                float(line["allocated_gib"]) * 1024,
                float(line["predicted_gib"]) * 1024,
                peak / MIB,
            )  # fmt: skip
            for line, peak in zip(measured, pool.map(_reference, jobs), strict=True)
        ]


def table(path: Path) -> str:
    """The docs table: the H200's allocator against the predictions then and now."""
    rows = read_rows(path)
    body = [
        [row["case"], row["variant"], row["allocated_mib"], row["deviation_then"], row["deviation_now"]] for row in rows
    ]
    columns = ["case", "variant", "H200 allocated (MiB)", "prediction then", "prediction now"]
    return markdown_table(columns, body)


def _spread(rows: list[dict[str, str]], when: str) -> Spread:
    return Spread(tuple(float(row[f"deviation_{when}"]) for row in rows), PREDICTION_TOLERANCE)


def summary(path: Path) -> str:
    """The docs' figures: the rows within the tolerance now and then, under the allocator, and those left."""
    rows = read_rows(path)
    reduced = [row for row in rows if "reference batch" not in row["case"]]
    reference = [row for row in rows if "reference batch" in row["case"]]
    now, then = _spread(reduced, "now"), _spread(reduced, "then")
    left = [row for row in reduced if abs(float(row["deviation_now"])) > PREDICTION_TOLERANCE]
    return prose(
        f"Within {PREDICTION_TOLERANCE:.0%}: {now.of()} reduced-size rows now ({then.within} then), {now.under} under "
        f"the allocator ({then.under} then); {_spread(reference, 'now').of()} reference batches "
        f"({_spread(reference, 'then').within} then), {_spread(reference, 'now').range()}. The {len(left)} rows left "
        f"are {_spread(left, 'now').range()} off ({_spread(left, 'then').range()} then): {models_by_variant(left)}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--workers", type=int, default=2, help="processes computing the fake-mode predictions")
    parser.add_argument("--reference-only", action="store_true", help="predict the reference-batch rows only")
    args = parser.parse_args(argv)
    rows = measure(args.workers) if not args.reference_only else []
    rows += reference_rows(args.workers)
    if args.reference_only:  # the prediction rows as the last full run wrote them
        rows = [row for row in read_rows(Path(args.csv)) if "reference batch" not in row["case"]] + rows
    write_csv(args.csv, rows)
    for kind, chosen in (("prediction", False), ("reference-batch", True)):
        kept = [row for row in rows if ("reference batch" in row["case"]) == chosen]
        for when in ("then", "now"):
            spread = _spread(kept, when)
            print(f"{kind} rows, {when}: {spread.of()} within {PREDICTION_TOLERANCE:.0%} of the H200's allocator; "
                  f"{spread.under} under; {spread.range()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
