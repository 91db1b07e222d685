"""One rank's bytes on the CPU: unsharded (what a DDP rank holds) vs FSDP2 vs FSDP2 + CPU offload, against the planner.

    python benchmarks/claims/sharded_cpu_memory.py [--csv benchmarks/claims/sharded_cpu_memory.csv]
    python benchmarks/claims/sharded_cpu_memory.py --table    # print the docs table from the CSV

sapiens_tiny on 4 images of 64×48, AdamW, two real training steps per case on 2 gloo ranks (the
model sharded as ``fsdp_memopt`` shards it), counted by the MemoryTracker on rank 0: device bytes
at the peak, and host bytes (the offloaded shards, their gradients and AdamW state). The
prediction is the planner's: the unsharded step's fake-mode profile turned into one rank's
(:func:`~lightning_memopt.planner.sharding.sharded_estimate`). On a CPU-only machine the host is
the device, so offloaded tensors are counted as host memory by name (``profile_step(host_parameters=True)``).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lightning_memopt.memory import profile_step
from lightning_memopt.models import create_model
from lightning_memopt.planner.estimate import from_profile
from lightning_memopt.planner.sharding import ShardedModel, Sharding, sharded_estimate
from lightning_memopt.strategies.sharding import shard_model

WORLD = 2
IMAGES = torch.randn(4, 3, 64, 48, generator=torch.Generator().manual_seed(0))
# setting -> (sharded, offloaded)
SETTINGS = {"unsharded (a DDP rank)": (False, False), "FSDP2 ×2": (True, False), "FSDP2 ×2 + CPU offload": (True, True)}
PRECISIONS = ("32-true", "bf16-mixed")
_KIB = 2**10


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("sapiens_tiny")


def _profile(mode: str, precision: str, sharded: bool, offloaded: bool):
    def shard(model: torch.nn.Module) -> None:
        if not sharded:
            return
        options: dict = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offloaded else {}
        if precision != "32-true":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(model, **options)

    return profile_step(
        _model,
        IMAGES,
        loss_fn=lambda model, images: model(images).square().mean(),
        optimizer=lambda parameters: torch.optim.AdamW(parameters),
        mode=mode,
        precision=precision,
        steps=2,
        prepare_model=shard,
        host_parameters=offloaded and mode == "real",
    )


def _run(rank: int, port: int, csv: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = []
    for precision in PRECISIONS:
        unsharded = from_profile(_profile("fake", precision, False, False)) if rank == 0 else None
        for setting, (sharded, offloaded) in SETTINGS.items():
            measured = _profile("real", precision, sharded, offloaded)
            if rank != 0:
                continue
            sharding = Sharding(WORLD if sharded else 1, cpu_offload=offloaded)
            predicted = sharded_estimate(unsharded, ShardedModel.of(_model()), sharding, precision)
            row = {
                "setting": setting,
                "precision": precision,
                "measured_device_kib": round(measured.peak_bytes / _KIB, 1),
                "predicted_device_kib": round(predicted.peak_bytes / _KIB, 1),
                "measured_host_kib": round(measured.offloaded_bytes / _KIB, 1),
                "predicted_host_kib": round(predicted.host_bytes / _KIB, 1),
            }
            rows.append(row)
            print(", ".join(f"{key} {value}" for key, value in row.items()), flush=True)
    if rank == 0:
        write_csv(csv, rows)
    dist.destroy_process_group()


def _error(measured: str, predicted: str) -> str:
    return f"{(float(predicted) - float(measured)) / float(measured):+.1%}" if float(measured) else "–"


def table(path: Path) -> str:
    """The docs' markdown table, from the CSV."""
    lines = [
        [
            row["setting"],
            row["precision"],
            row["measured_device_kib"],
            f"{row['predicted_device_kib']} ({_error(row['measured_device_kib'], row['predicted_device_kib'])})",
            row["measured_host_kib"],
            f"{row['predicted_host_kib']} ({_error(row['measured_host_kib'], row['predicted_host_kib'])})",
        ]
        for row in read_rows(path)
    ]
    columns = ["rank 0 of 2", "precision", "device KiB, measured", "predicted", "host KiB, measured", "predicted"]
    return markdown_table(columns, lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_run, args=(port, args.csv), nprocs=WORLD)


if __name__ == "__main__":
    main()
