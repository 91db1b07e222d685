"""A host-bound H200 case run on this CPU: r50 batch 32, whose checkpointed steps the H200's host set the time of.

Its twin here is the same network (IResNet r50's 24 blocks, the face task's loss) with every stage 4 channels wide
on 16² inputs, so the arithmetic is negligible and the step is the host's work. It runs without checkpointing and
under the implementation the H200 measured (``cost_model_h200``'s wrappers: ``torch.utils.checkpoint`` with a
clone of every batch-norm buffer per call, selective with PyTorch's contexts), interleaved round by round, the
fastest round kept. Beside each ratio: the H200's, and the planner's price in this CPU's own units (its host time
per kernel, from the unchecked twin; the narrow models' Python work per wrapped call and per forward op, as
``cost_model_h200`` prices it). The last row sets the H200's host time per kernel on r50 beside this CPU's: how
much slower that host runs the same work, the factor the catalogue's per-kernel price (fitted on the H200) and its
per-region prices (measured here) do not share.

    python benchmarks/calibration/host_twin.py      # ~15 seconds on 2 cores (most of it the region costs' fit)
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, prose, read_rows, write_csv
from calibration.cost_model_h200 import _OldCheckpoint, measured_seconds, old_region_seconds, then_work
from gpu_truth.cases import face

from lightning_memopt.planner.hardware import gpu
from lightning_memopt.planner.host import fastest_seconds
from lightning_memopt.planner.step_time import profiled_steps
from lightning_memopt.tasks import FaceRecognitionModule

CASE = face("r50", 32)  # the H200's case: its step time rows, its profile's kernels and wrapped blocks
VARIANTS = ("none", "full", "selective")
TWIN = {"widths": (4, 4, 4, 4), "embedding_size": 8, "input_size": 16}
PER_KERNEL = "host time per kernel, µs (the planner's column: the catalogue's)"


def twin(variant: str) -> FaceRecognitionModule:
    """The narrow r50, its blocks wrapped as the measured implementation wrapped them under ``variant``."""
    module = FaceRecognitionModule(num_classes=16, backbone="r50", backbone_options=TWIN)
    if variant != "none":
        network = module.backbone
        for stage in (network.layer1, network.layer2, network.layer3, network.layer4):
            for index, block in enumerate(stage):
                stage[index] = _OldCheckpoint(block, selective=variant == "selective")
    return module.train()


def twin_seconds(rounds: int = 15, device: torch.device | str = "cpu") -> dict[str, float]:
    """The fastest training step (loss, backward) of each variant's twin on ``device``; one thread, variants
    interleaved, the gradients set to ``None`` first in each (as the H200's steps were timed: no gradient is added
    to). On a GPU its tiny kernels leave the step to the host that queues them; each step waits for them."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(2, 3, 16, 16, generator=generator), torch.randint(0, 16, (2,), generator=generator)
    batch = (images.to(device), labels.to(device))

    def step(module: FaceRecognitionModule) -> None:
        module.zero_grad(set_to_none=True)
        module.training_step(batch, 0).backward()

    runs = {variant: functools.partial(step, twin(variant).to(device)) for variant in VARIANTS}
    return fastest_seconds(runs, rounds, warmups=2, device=device)


def then_kernels(variant: str = "none") -> float:
    """The kernels of r50's step under ``variant`` as the measured implementation counted them (the twin's, one for
    one)."""
    return then_work()[CASE.name, variant][0]


def measure(rounds: int = 15) -> list[dict]:
    """Rows: each variant's ratio here, on the H200 and as priced in this CPU's units; then both hosts' time per
    kernel of the unchecked step."""
    h200 = gpu("h200_141gb")
    steps = profiled_steps(CASE.build, CASE.batch(), h200, {"none": None, "full": "preset", "selective": "selective"})
    kernels = {variant: then_kernels(variant) for variant in VARIANTS}
    regions = old_region_seconds(("full", "selective"))
    seconds = twin_seconds(rounds)
    per_kernel = seconds["none"] / kernels["none"]  # the twin runs the case's kernels, one for one
    here = replace(h200, kernel_seconds=per_kernel, region_seconds=regions)
    on_h200 = measured_seconds()[CASE.name]
    rows = []
    for variant in VARIANTS:
        priced = kernels[variant] * per_kernel + steps[variant].cost(here).checkpointing
        rows.append(
            {
                "variant": variant,
                "this_cpu": f"{seconds[variant] / seconds['none']:.3f}",
                "h200": f"{on_h200[variant] / on_h200['none']:.3f}",
                "priced_here": f"{priced / (kernels['none'] * per_kernel):.3f}",
            }
        )
    rows.append(
        {
            "variant": PER_KERNEL,
            "this_cpu": f"{per_kernel * 1e6:.1f}",
            "h200": f"{on_h200['none'] / kernels['none'] * 1e6:.1f}",
            "priced_here": f"{h200.kernel_seconds * 1e6:.1f}",
        }
    )
    for row in rows:
        print(*row.values(), sep="\t", flush=True)
    return rows


def table(path: Path) -> str:
    rows = read_rows(path)
    body = [[row["variant"], row["this_cpu"], row["h200"], row["priced_here"]] for row in rows]
    columns = ["r50 (fp32)", "this CPU, twin × none", "H200, b32 × none", "planner, this CPU's units × none"]
    return markdown_table(columns, body)


def summary(path: Path) -> str:
    """The docs' sentence: the twin's ratios against the H200's, and the two hosts' time per kernel."""
    rows = {row["variant"]: row for row in read_rows(path)}
    modes = [variant for variant in VARIANTS if variant != "none"]
    speed = rows[PER_KERNEL]
    factor = float(speed["h200"]) / float(speed["this_cpu"])
    carried = max(abs(float(rows[mode]["this_cpu"]) / float(rows[mode]["h200"]) - 1) for mode in modes)
    priced = max(abs(float(rows[mode]["priced_here"]) / float(rows[mode]["this_cpu"]) - 1) for mode in modes)
    return prose(
        "On this CPU the twin's checkpointed steps cost "
        + ", ".join(f"{rows[mode]['this_cpu']}× ({mode})" for mode in modes)
        + " of its unchecked step, where the H200's host-bound r50 step cost "
        + ", ".join(f"{rows[mode]['h200']}×" for mode in modes)
        + f" (within {carried:.0%}); priced in this CPU's own units the planner says "
        + ", ".join(f"{rows[mode]['priced_here']}×" for mode in modes)
        + f" (within {priced:.0%} of this CPU's). The H200's host spent {speed['h200']} µs a kernel on the unchecked "
        f"step (each also a CUDA launch), this CPU {speed['this_cpu']} µs on its twin ({factor:.1f}×), while the "
        f"catalogue prices the kernels at the H200's {speed['priced_here']} µs and the wrapped blocks' Python at this "
        "CPU's speed."
    )


def main(argv: list[str] | None = None) -> int:
    parser = TableParser(__doc__, __file__, table, rounds=15)
    args = parser.parse_args(argv)
    write_csv(args.csv, measure(args.rounds))
    print(summary(Path(args.csv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
