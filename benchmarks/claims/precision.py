"""32-true vs bf16-mixed per preset: activation memory at the step's peak, and step time through PrecisionSwitch.

    python benchmarks/claims/precision.py [--only r18,sapiens_2b] [--time r18,sapiens_0.3b] [--rounds 2]

Activations: fake-mode profiles (nothing allocated) of each preset's reference training batch, the
same runs as ``memory_profile.py``, under the autocast PrecisionSwitch uses (no weight-cast cache).
Step time: real CPU training steps through a Trainer with ``PrecisionSwitch("32-true")`` and
``PrecisionSwitch("bf16-mixed")``, the two interleaved round by round in one process, at sizes a
CPU runs in seconds; the ratio is bf16 / fp32 (below 1: bf16 is faster). By default only r18 and
r50 are timed: on a CPU without native bf16 a bf16 step of sapiens_0.3b at 256×192 takes minutes.
Writes precision.csv.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, cpu_trainer, markdown_table, read_rows, write_csv
from claims.memory_profile import REFERENCE_RUNS, profile_preset

from lightning_memopt.callbacks import PrecisionSwitch
from lightning_memopt.callbacks.training_summary import TrainingSummary
from lightning_memopt.cli.config import config_dir

TARGET = 0.6  # issue 6: bf16-mixed activations at most 0.6 × fp32
# preset -> overrides of a real training run a 2-core CPU steps in seconds (fp32)
TIMING_RUNS = {
    "r18": ["model=r18", "data.batch_size=8", "data.samples_per_class=1"],
    "r50": ["model=r50", "data.batch_size=8", "data.samples_per_class=1"],
    "sapiens_0.3b": [
        "experiment=sapiens_2b_normal",
        "model=sapiens_0.3b",
        "model.warmup_steps=1",
        "data.image_size=[256,192]",
    ],
    "cotracker2": [
        "experiment=cotracker2_kubric",
        "data.image_size=[192,256]",
        "data.sequence_len=8",
        "data.traj_per_sample=64",
    ],
}
_GIB = 2**30


def step_seconds(name: str, rounds: int, steps: int = 3) -> dict[str, float]:
    """Training seconds over ``steps`` steps per precision, the fastest of ``rounds`` interleaved runs."""
    overrides = [*TIMING_RUNS[name], "trainer=cpu", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    seconds: dict[str, list[float]] = {"32-true": [], "bf16-mixed": []}
    for _ in range(rounds):
        for precision in seconds:
            torch.manual_seed(0)
            summary = TrainingSummary()
            trainer = cpu_trainer(steps, [PrecisionSwitch(precision), summary], limit_val_batches=0)
            trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))
            seconds[precision].append(summary.summary.train_seconds / steps)
    return {precision: min(values) for precision, values in seconds.items()}


def table(path: Path) -> str:
    """The docs' table: activations from memory_profile.csv (the rows of the memory-profile table), times from ours.

    Both benchmarks profile through ``memory_profile.profile_preset``; the memory-profile CSV is the one place those
    profiles are kept, so the two tables cannot disagree. This script's CSV contributes the step times.
    """
    profiles = {(row["preset"], row["precision"]): row for row in read_rows(path.with_name("memory_profile.csv"))}
    times = {row["preset"]: row for row in read_rows(path)}
    lines = []
    for preset in dict.fromkeys(name for name, _ in profiles):
        fp32, bf16 = profiles[(preset, "fp32")], profiles[(preset, "bf16-mixed")]
        ratio = float(bf16["activations_gib"]) / float(fp32["activations_gib"])
        timed = times.get(preset, {})
        time_cell = "—"
        if timed.get("timing_run"):
            batch = re.search(r"data\.batch_size=(\d+)", timed["timing_run"])
            time_cell = (
                f"{float(timed['step_time_ratio']):.1f} ({float(timed['fp32_step_seconds']):.2f} → "
                f"{float(timed['bf16_step_seconds']):.2f} s{f', batch {batch.group(1)}' if batch else ''})"
            )
        lines.append(
            [
                preset,
                fp32["batch"],
                f"{float(fp32['activations_gib']):.2f}",
                f"{float(bf16['activations_gib']):.2f}",
                f"**{ratio:.3f}**",
                "met" if ratio <= TARGET else "missed",
                time_cell,
            ]
        )
    columns = ["preset", "batch", "fp32 activations GiB", "bf16-mixed GiB", "ratio", f"≤ {TARGET:g}"]
    return markdown_table([*columns, "step time bf16 / fp32 (CPU)"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table, rounds=2)
    parser.add_argument("--only", default="", help="comma-separated presets to profile (default: all)")
    parser.add_argument("--time", default="r18,r50", help=f"presets to time, of: {', '.join(TIMING_RUNS)}")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(REFERENCE_RUNS)
    timed = [n for n in args.time.split(",") if n]
    rows = []
    print(f"{'preset':<14}{'batch':>6}{'fp32 act GiB':>14}{'bf16 act GiB':>14}{'ratio':>7}  target  "
          f"{'fp32 s/step':>11}{'bf16 s/step':>12}{'time ratio':>11}")  # fmt: skip
    for name in names:
        fp32, bf16 = profile_preset(name, "fp32"), profile_preset(name, "bf16-mixed")
        ratio = bf16["activations_gib"] / fp32["activations_gib"]
        times = step_seconds(name, args.rounds) if name in timed else {}
        row = {
            "preset": name,
            "batch": fp32["batch"],
            "fp32_activations_gib": fp32["activations_gib"],
            "bf16_activations_gib": bf16["activations_gib"],
            "activation_ratio": ratio,
            "meets_target": ratio <= TARGET,
            "fp32_peak_gib": fp32["peak_gib"],
            "bf16_peak_gib": bf16["peak_gib"],
            "fp32_step_seconds": times.get("32-true", float("nan")),
            "bf16_step_seconds": times.get("bf16-mixed", float("nan")),
            "timing_run": " ".join(TIMING_RUNS[name]) if times else "",
        }
        row["step_time_ratio"] = row["bf16_step_seconds"] / row["fp32_step_seconds"] if times else float("nan")
        rows.append(row)
        print(
            f"{name:<14}{row['batch']:>6}{row['fp32_activations_gib']:>14.2f}{row['bf16_activations_gib']:>14.2f}"
            f"{ratio:>7.2f}  {'met' if row['meets_target'] else 'MISSED':<6}  {row['fp32_step_seconds']:>11.2f}"
            f"{row['bf16_step_seconds']:>12.2f}{row['step_time_ratio']:>11.2f}",
            flush=True,
        )
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
