"""Resume equality: memopt-train resumed from its own step-k checkpoint ends with the uninterrupted run's weights.

For each case, one uninterrupted run saves a checkpoint after every step; runs resumed from some of
them (mid-epoch and at an epoch's end) then go on to the same last step. The figure is the largest
|Δw| between the final weights (``last.ckpt``) of the resumed and the uninterrupted run, over every
parameter and buffer. The runs use augmentation, dropout and Partial FC's sampled classes, so the data
order, its position, the per-sample augmentation and the random generators all have to come back.

    python benchmarks/claims/exact_resume.py                       # every case, writes exact_resume.csv
    python benchmarks/claims/exact_resume.py --cases plain --resume-from 3 --csv /tmp/x.csv
    python benchmarks/claims/exact_resume.py --table               # the docs table from the CSV
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

# A tiny face run with every source of randomness on: augmentation, dropout, sampled softmax classes.
TINY_RUN = [
    "model=iresnet_tiny",
    "model.backbone_options.dropout=0.2",
    "model.sample_rate=0.5",
    "data.image_size=32",
    "data.num_classes=8",
    "data.samples_per_class=4",
    "data.val_samples_per_class=1",
    "data.augmentation.rotation_degrees=10",
    "data.augmentation.color_jitter=0.2",
    "trainer=cpu",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "logger=none",
]
CASES = {
    "plain": ["data.batch_size=8"],
    "adaptive_precision": ["data.batch_size=8", "memopt=[adaptive,precision]"],
    "ddp": ["data.batch_size=4", "strategy=ddp", "trainer.devices=2"],  # 2 CPU ranks (gloo)
}
# 4 batches an epoch: steps 3 and 6 are mid-epoch, 4 ends the first epoch
RESUME_FROM = (3, 4, 6)
STEPS = 8


def memopt_train(args: list[str], cwd: Path) -> None:
    """Run memopt-train with ``args`` in ``cwd``; raise with its output when it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_memopt.train", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        raise RuntimeError(f"memopt-train {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model state of ``folder/last.ckpt``."""
    return torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every floating-point tensor of two state dicts with the same keys."""
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a if torch.is_floating_point(a[key]))


def resume_gaps(case: str, resume_from: tuple[int, ...], steps: int, work: Path) -> list[dict]:
    """One uninterrupted run of ``case`` and one resumed run per step of ``resume_from``; a row for each."""
    args = [*TINY_RUN, *CASES[case], f"trainer.max_steps={steps}"]
    every_step = work / "every_step"
    memopt_train(
        [
            *args,
            f"callbacks.last_checkpoint.dirpath={work / 'full'}",
            "+callbacks.every_step={_target_:lightning.pytorch.callbacks.ModelCheckpoint,"
            f"dirpath:'{every_step}',filename:'step{{step}}',auto_insert_metric_name:false,"
            "every_n_train_steps:1,save_top_k:-1}",
        ],
        work,
    )
    full = final_weights(work / "full")
    rows = []
    for step in resume_from:
        resumed = work / f"resumed_{step}"
        memopt_train(
            [*args, f"ckpt_path={every_step / f'step{step}.ckpt'}", f"callbacks.last_checkpoint.dirpath={resumed}"],
            work,
        )
        gap = largest_difference(final_weights(resumed), full)
        rows.append({"case": case, "steps": steps, "resumed_from_step": step, "max_abs_dw": gap})
        print(f"{case:<30} resumed from step {step} of {steps}: max |Δw| = {gap:.3g}", flush=True)
    return rows


def table(path: Path) -> str:
    """The docs' table from the CSV: one row per case, the largest |Δw| over its resume points."""
    by_case: dict[str, list[dict[str, str]]] = {}
    for row in read_rows(path):
        by_case.setdefault(row["case"], []).append(row)
    lines = [
        [
            " ".join(f"`{override}`" for override in CASES[case]),
            ", ".join(row["resumed_from_step"] for row in rows),
            rows[0]["steps"],
            f"{max(float(row['max_abs_dw']) for row in rows):.3g}",
        ]
        for case, rows in by_case.items()
    ]
    return markdown_table(
        [
            "run (all: tiny IResNet, augmentation, dropout, Partial FC 0.5)",
            "resumed from step",
            "of steps",
            "max \\|Δw\\| vs uninterrupted",
        ],
        lines,
    )


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--resume-from", default=",".join(map(str, RESUME_FROM)), help="comma-separated steps")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    cases = [case for case in CASES if case in args.cases.split(",")]
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown or not cases:
        parser.error(f"--cases: unknown {sorted(unknown)}; choose from {list(CASES)}")
    resume_from = tuple(int(step) for step in args.resume_from.split(","))
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as work:
            rows += resume_gaps(case, resume_from, args.steps, Path(work))
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
