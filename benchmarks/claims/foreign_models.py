"""Models that declare nothing: the blocks found, the activation peak with and without the default
checkpointing, and the planner's choice at three budgets against the real peak.

    python benchmarks/claims/foreign_models.py            # measure, print, write foreign_models.csv
    python benchmarks/claims/foreign_models.py --table    # print the docs table from foreign_models.csv

Two ``transformers`` models built from a config (random weights, nothing downloaded), trained on
random 3 × 128 × 128 images, batch 8, AdamW, fp32 on the CPU:
- ``vit_small``: ``ViTForImageClassification``, width 384, 12 layers, 6 heads, patch 16;
- ``resnet50``: ``ResNetForImageClassification``, bottleneck blocks 3-4-6-3, widths 256 … 2048.

Memory is counted by the project's tracker on real CPU tensors, without checkpointing and with
``ActivationCheckpointing()``'s default (``"auto"``: here the discovered blocks): the activations
the forward pass leaves for the backward (its peak of saved tensors), and the peak of two whole
training steps (``profile_step``, mode "real": weights, gradients, AdamW state, activations). The planner is
run for each model at three budgets (the 10 % safety margin taken off each): above the unchecked
peak, between the two peaks, and just above the checkpointed peak. Precision is kept at fp32 (bf16
is emulated on this CPU, which would make the real steps take minutes); micro-batching is
searched. Each plan is then trained for two real steps inside a ``SimulatedDevice`` of its budget,
which raises an out-of-memory error past it: the real peak must be within the budget.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, write_csv

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import MemoryTracker, SimulatedDevice, is_oom_error, profile_step
from lightning_memopt.models.structure import model_structure
from lightning_memopt.planner import Knobs, gpu, plan, with_budget

_MIB = 2**20
BATCH_SIZE = 8
IMAGE = 128
SAFETY = 0.1


def vit_small() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE,
        patch_size=16,
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        intermediate_size=1536,
        num_labels=100,
    )
    return ViTForImageClassification(config)


def resnet50() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[256, 512, 1024, 2048],
        depths=[3, 4, 6, 3],
        layer_type="bottleneck",
        num_labels=100,
    )
    return ResNetForImageClassification(config)


MODELS = {"vit_small": vit_small, "resnet50": resnet50}


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(pixel_values=images).logits, labels)


def optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters)


def measured_peaks(build, policy: str | None, batch) -> tuple[int, int]:
    """(peak of two real training steps, activations the forward pass leaves for backward), counted by the tracker."""
    torch.manual_seed(0)
    model = build()
    if policy is not None:
        apply_activation_checkpointing(model, policy)
    tracker = MemoryTracker()
    with tracker:
        tracker.track_module(model)
        tracker.track(batch, "inputs")
        with tracker.in_phase("forward"):
            loss = loss_fn(model, batch)
        activations = tracker.peak.by_category()["activations"]
        with tracker.in_phase("backward"):
            loss.backward()
    tracker.remove_hooks()
    return profile_step(model, batch, loss_fn=loss_fn, optimizer=optimizer).peak_bytes, activations


def real_peak(build, knobs: Knobs, batch, budget: int) -> int | None:
    """The real peak of two steps with ``knobs`` inside a SimulatedDevice of ``budget`` bytes; None on OOM."""
    images, labels = batch
    size = knobs.micro_batch_size or len(images)
    try:
        with SimulatedDevice(budget) as device:
            torch.manual_seed(0)
            model = build()
            policy = knobs.checkpoint_policy()
            if policy is not None:
                apply_activation_checkpointing(model, policy)
            steps = optimizer(model.parameters())
            for _ in range(2):
                for micro in zip(images.split(size), labels.split(size), strict=True):
                    (loss_fn(model, micro) * len(micro[0]) / len(images)).backward()
                steps.step()
                steps.zero_grad(set_to_none=True)
    except Exception as error:
        if not is_oom_error(error):
            raise
        return None
    return device.peak.total_bytes


def measure(names: list[str]) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(BATCH_SIZE, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, 100, (BATCH_SIZE,)))
    rows = []
    for name in names:
        build = MODELS[name]
        with torch.device("meta"):
            structure = model_structure(build())
        unchecked, unchecked_activations = measured_peaks(build, None, batch)
        checkpointed, checkpointed_activations = measured_peaks(build, "auto", batch)
        print(
            f"{name}: {structure.describe_blocks()}; peak {unchecked / _MIB:.1f} → {checkpointed / _MIB:.1f} MiB, "
            f"activations {unchecked_activations / _MIB:.1f} → {checkpointed_activations / _MIB:.1f} MiB",
            flush=True,
        )
        budgets = {
            "above the unchecked peak": 1.05 * unchecked / (1 - SAFETY),
            "between the two peaks": (unchecked + checkpointed) / 2 / (1 - SAFETY),
            "just above the checkpointed peak": 1.05 * checkpointed / (1 - SAFETY),
        }
        for label, budget in budgets.items():
            result = plan(
                build,
                batch,
                with_budget(gpu("a100_80gb"), budget / 2**30),
                loss_fn=loss_fn,
                optimizer=optimizer,
                precisions=["32-true"],
                safety_margin=SAFETY,
                cpu_offload=(False,),  # the plan is trained in this process: no fsdp_memopt
            )
            chosen = result.chosen
            real = real_peak(build, chosen.knobs, batch, int(budget)) if chosen is not None else None
            row = {
                "model": name,
                "blocks": structure.describe_blocks(),
                "peak_mib": round(unchecked / _MIB, 1),
                "activations_mib": round(unchecked_activations / _MIB, 1),
                "checkpointed_peak_mib": round(checkpointed / _MIB, 1),
                "checkpointed_activations_mib": round(checkpointed_activations / _MIB, 1),
                "budget": label,
                "budget_mib": round(budget / _MIB, 1),
                "plan": chosen.knobs.describe() if chosen is not None else "nothing fits",
                "predicted_peak_mib": round(chosen.peak_bytes / _MIB, 1) if chosen is not None else "",
                "real_peak_mib": round(real / _MIB, 1) if real is not None else "OOM",
                "within_budget": real is not None and real <= budget,
                "profiles": result.profiles,
            }
            print(
                f"  {label} ({row['budget_mib']} MiB): {row['plan']}, predicted {row['predicted_peak_mib']} MiB, "
                f"real {row['real_peak_mib']} MiB",
                flush=True,
            )
            rows.append(row)
    return rows


def table(path: Path) -> str:
    """The docs' markdown table, from the CSV."""
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    lines = [
        "| model | blocks found | activations MiB: none → auto | step peak MiB: none → auto | budget (MiB) | plan "
        "| predicted / real peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        real = row["real_peak_mib"] + ("" if row["within_budget"] == "True" else " **over**")
        if row["plan"] == "nothing fits":
            real = "—"
        lines.append(
            f"| {row['model']} | {row['blocks']} | {row['activations_mib']} → {row['checkpointed_activations_mib']} "
            f"| {row['peak_mib']} → {row['checkpointed_peak_mib']} | {row['budget']} ({row['budget_mib']}) "
            f"| {row['plan']} | {row['predicted_peak_mib']} / {real} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    write_csv(args.csv, measure(args.models))
    print(table(Path(args.csv)))


if __name__ == "__main__":
    main()
