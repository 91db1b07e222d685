"""Fake-mode memory profile of every preset at its reference batch, in fp32 and bf16-mixed.

Also measures MemoryMonitor's overhead: step time with vs without it, as a ratio in one process.

    python benchmarks/claims/memory_profile.py [--only r18,sapiens_2b] [--csv benchmarks/claims/memory_profile.csv]
    python benchmarks/claims/memory_profile.py --overhead-only   # MemoryMonitor's overhead: memory_monitor_overhead.csv
    python benchmarks/claims/memory_profile.py --table    # print the docs table from the CSV

Nothing is allocated for the profiles (FakeTensorMode), so the 2 B-parameter Sapiens runs on a laptop.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, cpu_trainer, markdown_table, read_rows, write_csv

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.profile import profile

# preset -> the overrides that give its reference training batch (PRESETS.md)
REFERENCE_RUNS = {
    **{
        f"r{depth}": [f"model=r{depth}", "data.num_classes=85742", "data.batch_size=128"]
        for depth in (18, 34, 50, 100, 200)
    },
    **{
        f"sapiens_{size}": ["experiment=sapiens_2b_normal", f"model=sapiens_{size}", "data.num_samples=1"]
        for size in ("0.3b", "0.6b", "1b", "2b")
    },
    "cotracker2": ["experiment=cotracker2_kubric", "data.num_clips=1", "data.val_clips=0"],
    "cotracker3": ["experiment=cotracker3_online", "data.num_clips=1", "data.val_clips=0"],
}
PRECISIONS = {"fp32": "precision=32_true", "bf16-mixed": "precision=bf16_mixed"}
_GIB = 2**30


def profile_preset(name: str, precision: str) -> dict:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("profile", overrides=[*REFERENCE_RUNS[name], PRECISIONS[precision], "trainer=cpu"])
    started = time.perf_counter()
    result = profile(cfg)
    row = {
        "preset": name,
        "precision": precision,
        "batch": cfg.data.batch_size,
        "peak_gib": result.peak_bytes / _GIB,
        "phase": result.peak_phase,
        "seconds": time.perf_counter() - started,
    }
    row.update({f"{k}_gib": v / _GIB for k, v in result.breakdown.items()})
    return row


def monitor_overhead(every_n_steps: int, steps: int, rounds: int = 2) -> float:
    """Step time with MemoryMonitor / without, r18 at 64×64, batch 16, runs interleaved in one process."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memopt.callbacks import MemoryMonitor
    from lightning_memopt.callbacks.training_summary import TrainingSummary
    from lightning_memopt.tasks import FaceRecognitionModule

    data = DataLoader(TensorDataset(torch.randn(16 * steps, 3, 64, 64), torch.arange(16 * steps) % 100), batch_size=16)
    seconds = {"without": 0.0, "with": 0.0}
    for _ in range(rounds):
        for variant in ("without", "with"):
            summary = TrainingSummary()
            callbacks = [summary] + ([MemoryMonitor(every_n_steps=every_n_steps)] if variant == "with" else [])
            trainer = cpu_trainer(steps, callbacks)
            trainer.fit(
                FaceRecognitionModule(num_classes=100, backbone="r18", backbone_options={"input_size": 64}), data
            )
            seconds[variant] += summary.summary.train_seconds
    return seconds["with"] / seconds["without"]


def table(path: Path) -> str:
    """The docs' markdown table, from the CSV."""
    columns = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
    rows = [
        [row["preset"], row["precision"], row["batch"], f"**{float(row['peak_gib']):.2f}**"]
        + [f"{float(row[f'{column}_gib']):.2f}" for column in columns]
        + [row["phase"]]
        for row in read_rows(path)
    ]
    header = ["preset", "precision", "batch", "peak GiB", *(c.replace("_", " ") for c in columns), "peak in"]
    return markdown_table(header, rows)


def overhead_table(path: Path) -> str:
    """The docs' table of MemoryMonitor's overhead, from ``memory_monitor_overhead.csv``."""
    notes = {"50": " (the default)", "1": " (every step tracked)"}
    lines = [
        [
            f"`every_n_steps={row['every_n_steps']}`{notes.get(row['every_n_steps'], '')}",
            row["steps"],
            f"**{float(row['step_time_ratio']):.3f}**",
        ]
        for row in read_rows(path)
    ]
    return markdown_table(["monitor setting", "steps per run", "step time with / without"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", default="", help="comma-separated presets (default: all)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--overhead-only", action="store_true")
    parser.add_argument("--overhead-csv", default=str(Path(__file__).with_name("memory_monitor_overhead.csv")))
    args = parser.parse_args()
    names = [] if args.overhead_only else [n for n in args.only.split(",") if n] or list(REFERENCE_RUNS)
    rows = []
    print(
        f"{'preset':<14}{'precision':<12}{'batch':>6}{'peak GiB':>10}{'params':>9}{'grads':>8}{'optim':>8}"
        f"{'inputs':>8}{'activ.':>9}{'temp.':>8}  phase      s"
    )
    for name in names:
        for precision in PRECISIONS:
            row = profile_preset(name, precision)
            rows.append(row)
            gib = [row[f"{k}_gib"] for k in ("parameters", "gradients", "optimizer_state", "inputs")]
            cells = [f"{name:<14}{precision:<12}{row['batch']:>6}{row['peak_gib']:>10.2f}{gib[0]:>9.2f}"]
            cells += [f"{gib[1]:>8.2f}{gib[2]:>8.2f}{gib[3]:>8.2f}{row['activations_gib']:>9.2f}"]
            cells += [f"{row['temporaries_gib']:>8.2f}  {row['phase']:<9}{row['seconds']:>5.0f}"]
            print("".join(cells), flush=True)
    if rows:
        write_csv(args.csv, rows)
    if not args.skip_overhead:
        overhead = []
        for every_n_steps, steps in ((50, 50), (1, 10)):
            ratio = monitor_overhead(every_n_steps, steps)
            overhead.append({"every_n_steps": every_n_steps, "steps": steps, "step_time_ratio": ratio})
            print(
                f"MemoryMonitor(every_n_steps={every_n_steps}) overhead over {steps} steps "
                f"(step time with / without, r18 64x64 batch 16): {ratio:.3f}",
                flush=True,
            )
        write_csv(args.overhead_csv, overhead)


if __name__ == "__main__":
    main()
