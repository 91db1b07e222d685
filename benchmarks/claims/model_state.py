"""Sapiens past one GPU: the plan memopt-plan picks on one 24 GB GPU (CPU offload allowed), one 80 GB GPU (unsharded),
and 2 / 4 / 8 GPUs of 40 GB (FSDP over all of them), with its predicted peak per GPU and its step time.

    python benchmarks/claims/model_state.py [--only sapiens_2b] [--csv benchmarks/claims/model_state.csv]
    python benchmarks/claims/model_state.py --table    # print the docs table from the CSV

Normals at 1024×768, batch 1 per GPU, planned in fake mode on the CPU (nothing is allocated), with
the catalogue's rates; each plan is the planner's pick for that setting (precision, attention,
checkpointing, micro-batches, offload), or "does not fit".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.plan_config import first_batch, instantiate_model
from lightning_memopt.planner import PlanError, gpu, plan

PRESETS = ("sapiens_0.3b", "sapiens_0.6b", "sapiens_1b", "sapiens_2b")
# setting -> (GPU, devices, plan() options)
SETTINGS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "1 × 24 GB, offload allowed": ("rtx3090_24gb", 1, {}),
    "1 × 80 GB, unsharded": ("a100_80gb", 1, {"cpu_offload": (False,)}),
    **{f"{n} × 40 GB, FSDP ×{n}": ("a100_40gb", n, {"shards": [n], "cpu_offload": (False,)}) for n in (2, 4, 8)},
}
_GIB = 2**30


def plan_preset(name: str, setting: str) -> dict:
    hardware, devices, options = SETTINGS[setting]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("plan", overrides=[f"model={name}", "data=synthetic_normals", "data.num_samples=1"])
    row: dict[str, Any] = {"preset": name, "setting": setting, "gpu": hardware, "devices": devices}
    started = time.perf_counter()
    try:
        result = plan(lambda: instantiate_model(cfg.model), first_batch(cfg), gpu(hardware), devices=devices, **options)
        chosen = result.chosen
    except PlanError:
        chosen = None
    row["seconds"] = round(time.perf_counter() - started, 1)
    if chosen is None:
        return {**row, "plan": "", "peak_gib": "", "host_gib": "", "step_seconds": ""}
    return {
        **row,
        "plan": chosen.knobs.describe(),
        "peak_gib": round(chosen.peak_bytes / _GIB, 2),
        "host_gib": round(chosen.host_bytes / _GIB, 2),
        "step_seconds": round(chosen.cost.total, 3),
    }


def table(path: Path) -> str:
    """The docs' markdown table, from the CSV: one row per preset, one column per setting.

    Each cell: the predicted peak per GPU, the host memory under CPU offload, the estimated step
    time and the knobs beyond those every plan shares (named in the first column's header).
    """
    rows = read_rows(path)
    plans = [row["plan"].split(", ") for row in rows if row["plan"]]
    shared = [part for part in plans[0] if all(part in plan for plan in plans)] if plans else []
    cells: dict[str, dict[str, str]] = {}
    for row in rows:
        if not row["plan"]:
            cell = "does not fit"
        else:
            host = f" + {float(row['host_gib']):.1f} host" if float(row["host_gib"]) else ""
            extra = [part for part in row["plan"].split(", ") if part not in shared and not part.startswith("FSDP")]
            cell = f"**{float(row['peak_gib']):.1f}**{host} GiB, {float(row['step_seconds']):.2f} s"
            cell += f" ({', '.join(extra)})" if extra else ""
        cells.setdefault(row["preset"], {})[row["setting"]] = cell
    settings = [setting for setting in SETTINGS if any(setting in by_setting for by_setting in cells.values())]
    lines = [[preset, *(cells[preset].get(setting, "") for setting in settings)] for preset in cells]
    return markdown_table([f"preset (all: {', '.join(shared)})", *settings], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", default="", help="comma-separated presets (default: all)")
    args = parser.parse_args()
    rows = []
    for name in [n for n in args.only.split(",") if n] or PRESETS:
        for setting in SETTINGS:
            row = plan_preset(name, setting)
            rows.append(row)
            peak = f"{row['peak_gib']:.2f} GiB" if row["plan"] else "does not fit"
            print(f"{name:<14}{setting:<28}{peak:>14}  {row['plan']}  ({row['seconds']:.0f} s to plan)", flush=True)
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
