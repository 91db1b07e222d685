"""Bytes all-reduced per DDP step for IResNet r50 / r100 under each gradient-compression hook.

    python benchmarks/claims/ddp_compression.py [--models r50 r100] [--steps 3]

Two CPU ranks (gloo) wrap the model in DDP with the hook the strategy presets register
(:func:`lightning_memopt.strategies.comm_hook`): plain all-reduce (as a Python hook, DDP's own
averaging), fp16, bf16, and PowerSGD at rank 1 / 2 / 4 (after a 2-step warm-up of plain
all-reduce). Every ``torch.distributed.all_reduce`` a hook issues, also from its future callbacks,
is counted (elements × element size) on rank 0, for the last step, after the warm-up. Two
samples of 3 × 112 × 112 per rank; the bytes do not depend on the batch. Writes
ddp_compression.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv
from torch.nn.parallel import DistributedDataParallel

from lightning_memopt import create_model
from lightning_memopt.strategies import comm_hook

HOOKS = [
    ("all-reduce (fp32)", "allreduce", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("PowerSGD rank 1", "powersgd", {"powersgd_rank": 1}),
    ("PowerSGD rank 2", "powersgd", {"powersgd_rank": 2}),
    ("PowerSGD rank 4", "powersgd", {"powersgd_rank": 4}),
]


class AllReduceCounter:
    """Counts the bytes of every ``torch.distributed.all_reduce`` call while installed (thread-safe)."""

    def __init__(self) -> None:
        self.bytes, self._lock, self._original = 0, threading.Lock(), dist.all_reduce

    def __enter__(self) -> AllReduceCounter:
        def counted(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            with self._lock:
                self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def step_bytes(model_name: str, hook_name: str, options: dict, steps: int) -> tuple[int, int]:
    """(bytes all-reduced in the last of ``steps`` steps, gradient elements)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(create_model(model_name), gradient_as_bucket_view=True)
    state, hook = comm_hook(hook_name, model.module, powersgd_warmup=2, **options)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randn(2, 3, 112, 112)  # BatchNorm1d needs two samples
    for _ in range(steps):
        with AllReduceCounter() as counter:
            model(images).square().mean().backward()  # DDP waits for the hooks' futures before returning
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elements = sum(p.numel() for p in model.parameters())
    return counter.bytes, elements


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for model_name in args.models:
        baseline = None
        for label, hook_name, options in (hook for hook in HOOKS if hook[0] in args.hooks):
            sent, elements = step_bytes(model_name, hook_name, options, args.steps)
            baseline = baseline or sent
            rows.append({"model": model_name, "hook": label, "gradient_elements": elements, "bytes_per_step": sent,
                         "compression": baseline / sent})  # fmt: skip
            if rank == 0:
                print(f"{model_name} {label}: {sent / 2**20:.2f} MiB per step, {baseline / sent:.1f}× less", flush=True)
    if rank == 0:
        write_csv(args.csv, rows)
    dist.destroy_process_group()


def table(path: Path) -> str:
    """The docs' table from the CSV: bytes all-reduced per step and the compression, one row per model."""
    by_model: dict[str, list[dict[str, str]]] = {}
    for row in read_rows(path):
        by_model.setdefault(row["model"], []).append(row)
    lines, hooks = [], []
    for model, rows in by_model.items():
        hooks = [row["hook"] for row in rows]
        cells = [f"{model} ({int(rows[0]['gradient_elements']) / 1e6:.1f} M)"]
        for row in rows:
            mib, compression = int(row["bytes_per_step"]) / 2**20, float(row["compression"])
            size = f"{mib:.1f} MiB" if mib >= 10 else f"{mib:.2f} MiB"
            if compression == 1:
                cells.append(size)
                continue
            factor = f"{compression:.1f}×" if compression < 10 else f"{compression:.0f}×"
            cells.append(f"{size} (**{factor}**)" if row["hook"] == "PowerSGD rank 1" else f"{size} ({factor})")
        lines.append(cells)
    columns = [hook.replace("PowerSGD rank", "rank") if hook != "PowerSGD rank 1" else hook for hook in hooks]
    return markdown_table(["model (gradient elements)", *columns], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table, steps=3)
    parser.add_argument("--models", nargs="+", default=["r50", "r100"])
    parser.add_argument("--hooks", nargs="+", default=[label for label, _, _ in HOOKS], help="a subset of the labels")
    args = parser.parse_args()
    if args.steps < 3:
        sys.exit("--steps must be ≥ 3: PowerSGD compresses after 2 warm-up steps")
    mp.spawn(run, args=(args, 29700 + os.getpid() % 200), nprocs=2)


if __name__ == "__main__":
    main()
