"""How well fake mode predicts a real step: fake-mode peak vs the real CPU peak (the project's tracker).

    python benchmarks/claims/fake_vs_real.py [--only "iresnet_tiny b8,sapiens_tiny b2"] [--csv PATH]

Cases: r18 and r50 at batch 32 (112×112), and the tiny vision presets, each in fp32 and bf16-mixed.
Target: every fake peak within 3 % of the real one. Writes fake_vs_real.csv (the cases run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, prose, read_rows, write_csv
from torch.nn import functional as F

from lightning_memopt.memory import profile_step
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule, TrackingModule

TOLERANCE = 0.03  # every fake peak within 3 % of the real one


def _face(backbone: str, size: int, batch: int):
    return (
        lambda: FaceRecognitionModule(num_classes=1000, backbone=backbone, backbone_options={"input_size": size}),
        lambda: (torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))),
    )


def _normals():
    def batch():
        return {
            "image": torch.randn(2, 3, 64, 48),
            "normal": F.normalize(torch.randn(2, 3, 64, 48), dim=1),
            "mask": torch.ones(2, 1, 64, 48, dtype=torch.bool),
        }

    return (lambda: NormalEstimationModule(backbone="sapiens_tiny"), batch)


def _tracking(backbone: str):
    def batch():
        frames, tracks = 8, 16
        return {
            "video": torch.rand(1, frames, 3, 64, 64) * 255,
            "tracks": torch.rand(1, frames, tracks, 2) * 63,
            "visibility": torch.ones(1, frames, tracks, dtype=torch.bool),
            "queries": torch.cat([torch.zeros(1, tracks, 1), torch.rand(1, tracks, 2) * 63], dim=2),
        }

    return (lambda: TrackingModule(backbone=backbone), batch)


CASES = {
    "r18 b32": _face("r18", 112, 32),
    "r50 b32": _face("r50", 112, 32),
    "iresnet_tiny b8": _face("iresnet_tiny", 32, 8),
    "sapiens_tiny b2": _normals(),
    "cotracker2_tiny": _tracking("cotracker2_tiny"),
    "cotracker3_tiny": _tracking("cotracker3_tiny"),
}


def table(path: Path) -> str:
    """The docs' table from the CSV: the fake-mode peak against the real one, per case and precision."""
    lines = [
        [
            row["case"],
            row["precision"],
            f"{float(row['fake_mib']):.1f}",
            f"{float(row['real_mib']):.1f}",
            f"{float(row['fake_over_real']):.4f}",
        ]
        for row in read_rows(path)
    ]
    return markdown_table(["case", "precision", "fake MiB", "real MiB", "fake / real"], lines)


def summary(path: Path) -> str:
    """The docs' figure: the largest deviation of fake from real, against the target."""
    worst = max(read_rows(path), key=lambda row: abs(float(row["fake_over_real"]) - 1))
    deviation = abs(float(worst["fake_over_real"]) - 1)
    where = f"in {worst['precision']} on `{worst['case']}`"
    return prose(f"Largest deviation: **{deviation:.2%}** (target {TOLERANCE:.0%}), {where}.")


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", default="", help=f"comma-separated cases (default: all): {', '.join(CASES)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CASES)
    rows = []
    print(f"{'case':<18}{'precision':<12}{'fake MiB':>10}{'real MiB':>10}{'fake/real':>11}   fake s  real s")
    worst = 0.0
    for name in names:
        build, make_batch = CASES[name]
        for precision in ("32-true", "bf16-mixed"):
            torch.manual_seed(0)
            batch = make_batch()
            started = time.perf_counter()
            fake = profile_step(build, batch, mode="fake", precision=precision)
            fake_seconds = time.perf_counter() - started
            started = time.perf_counter()
            real = profile_step(build(), batch, mode="real", precision=precision)
            real_seconds = time.perf_counter() - started
            ratio = fake.peak_bytes / real.peak_bytes
            worst = max(worst, abs(ratio - 1))
            print(
                f"{name:<18}{precision:<12}{fake.peak_bytes / 2**20:>10.1f}{real.peak_bytes / 2**20:>10.1f}"
                f"{ratio:>11.4f}{fake_seconds:>9.1f}{real_seconds:>8.1f}",
                flush=True,
            )
            rows.append(
                {
                    "case": name,
                    "precision": precision,
                    "fake_mib": fake.peak_bytes / 2**20,
                    "real_mib": real.peak_bytes / 2**20,
                    "fake_over_real": ratio,
                    "fake_seconds": fake_seconds,
                    "real_seconds": real_seconds,
                }
            )
    write_csv(args.csv, rows)
    print(f"largest deviation: {worst:.2%} (target {TOLERANCE:.0%})")


if __name__ == "__main__":
    main()
