"""Official checkpoints per preset: tensors renamed, reshaped, merged, fixed buffers checked, keys dropped.

    python benchmarks/claims/official_checkpoints.py            # convert every preset, print, write the CSV
    python benchmarks/claims/official_checkpoints.py --table    # print the docs table from official_checkpoints.csv

For every preset the official state dict is written with ``convert_to_official`` from the
preset built on the meta device (no values: key names and shapes only, so Sapiens-2B costs
nothing), then converted back to ours with the preset's layout; the row counts what that
conversion did, and a round trip must give back every key with its shape. The Sapiens MAE rows
convert a backbone-only pre-training file (class token, a 1 + 64 × 64 position table) the way
``model.pretrained_backbone=`` does. The behaviour column says which of the reference's behaviours
the preset reproduces by default (each has its own test).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv
from torch import Tensor

from lightning_memopt.models import create_model
from lightning_memopt.models.official import official_layout
from lightning_memopt.models.official.layout import ConversionReport, convert_to_official, convert_to_ours

PRESETS = (
    "r18",
    "r50",
    "r100",
    "r200",
    "sapiens_0.3b",
    "sapiens_0.6b",
    "sapiens_1b",
    "sapiens_2b",
    "cotracker2",
    "cotracker3",
    "cotracker3_offline",
)
MAE_PRESETS = ("sapiens_0.3b", "sapiens_2b")
# MAE pre-training: a class token and a position table over the 64 × 64 pre-training grid plus its class row.
_MAE_GRID_ROWS = 1 + 64 * 64

BEHAVIOUR = {
    "IResNet": "yes (nothing differs)",
    "Sapiens": "yes: head Dropout2d(0.1), raw output, the file's 64×48 position table",
    "CoTracker2": "yes: flow embedding, x-outer taps, border sampling, grid position table, query masks",
    "CoTracker3": "yes: border sampling, x-outer windows, motion-code order, no attention mask",
}


def _mae_backbone_file(official: dict[str, Tensor]) -> dict[str, Tensor]:
    backbone = {key.removeprefix("backbone."): value for key, value in official.items() if key.startswith("backbone.")}
    width = backbone["pos_embed"].shape[-1]
    backbone["pos_embed"] = torch.empty(1, _MAE_GRID_ROWS, width, device="meta")
    backbone["cls_token"] = torch.empty(1, 1, width, device="meta")
    return backbone


def _row(name: str, file: str, report: ConversionReport, official: dict[str, Tensor]) -> dict:
    return {
        "preset": name,
        "file": file,
        "official_tensors": len(official),
        "tensors": report.tensors,
        "renamed": len(report.renamed),
        "reshaped": len(report.reshaped),
        "merged": len(report.merged),
        "fixed_buffers": len(report.checked_fixed),
        "dropped": "; ".join(f"{key} ({reason})" for key, reason in report.dropped.items()) or "none",
        "behaviour": BEHAVIOUR[report.family],
    }


def measure(presets: tuple[str, ...]) -> list[dict]:
    """Convert every preset's official layout back to ours and count what the conversion did."""
    rows = []
    for name in presets:
        with torch.device("meta"):
            model = create_model(name)
        layout = official_layout(model)
        official = convert_to_official(model.state_dict(), layout)
        converted, report = convert_to_ours(official, layout)
        assert set(converted) == set(model.state_dict()), f"{name}: not every tensor of the model was placed"
        rows.append(_row(name, "release", report, official))
        print(f"{name}: {report.summary()}", flush=True)
        if name in MAE_PRESETS:
            mae = _mae_backbone_file(official)
            _, report = convert_to_ours(mae, official_layout(model, backbone_only=True))
            rows.append(_row(name, "MAE backbone", report, mae))
            print(f"{name} (MAE backbone): {report.summary()}", flush=True)
    return rows


def table(path: Path) -> str:
    """The docs' markdown table, from the CSV."""
    columns = ["preset", "official file", "tensors (ours)", "renamed", "reshaped", "merged", "fixed buffers checked"]
    keys = ["preset", "file", "tensors", "renamed", "reshaped", "merged", "fixed_buffers", "dropped", "behaviour"]
    rows = [[row[key] for key in keys] for row in read_rows(path)]
    return markdown_table([*columns, "dropped", "reference behaviour by default"], rows)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    args = parser.parse_args()
    write_csv(args.csv, measure(tuple(args.presets)))
    print(table(Path(args.csv)))


if __name__ == "__main__":
    main()
