"""Two CPU ranks (gloo) run real FSDP2 training steps, counted by the MemoryTracker, beside the planner's prediction.

python tests/planner/sharded_step_run.py      # prints "step NAME MEASURED PREDICTED" (rank 0's peak bytes) per case

Each case shards the model as ``fsdp_memopt`` does (:func:`~lightning_memopt.strategies.sharding.shard_model`)
and profiles two steps for real; the prediction turns the fake-mode profile of the unsharded step into
one rank's (:func:`~lightning_memopt.planner.sharding.sharded_estimate`).
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import profile_step
from lightning_memopt.models import create_model
from lightning_memopt.planner.estimate import from_profile
from lightning_memopt.planner.sharding import ShardedModel, Sharding, sharded_estimate
from lightning_memopt.strategies.sharding import shard_model
from lightning_memopt.tasks import NormalEstimationModule

IMAGES = torch.randn(4, 3, 64, 48)
# name -> (LightningModule or not, precision, checkpointed blocks)
CASES = {
    "sapiens_tiny-32-true": (False, "32-true", False),
    "sapiens_tiny-bf16-mixed": (False, "bf16-mixed", False),
    "sapiens_tiny-bf16-mixed-checkpointed": (False, "bf16-mixed", True),
    "normals-module-bf16-mixed": (True, "bf16-mixed", False),
}


def _build(lightning: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        NormalEstimationModule(backbone="sapiens_tiny", warmup_steps=0) if lightning else create_model("sapiens_tiny")
    )


def _profile(lightning: bool, precision: str, checkpointed: bool, mode: str, world: int = 1):
    def prepare(model: torch.nn.Module) -> None:
        if checkpointed:
            apply_activation_checkpointing(model, {"modules": "auto", "mode": "full"})
        if world > 1:
            half = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            shard_model(model, **({"mp_policy": half} if precision != "32-true" else {}))

    if lightning:
        normals = torch.nn.functional.normalize(torch.randn(4, 3, 64, 48), dim=1)
        batch, options = {"image": IMAGES, "normal": normals, "mask": torch.ones(4, 1, 64, 48, dtype=torch.bool)}, {}
    else:
        batch = IMAGES
        options = {"loss_fn": lambda m, x: m(x).square().mean(), "optimizer": lambda p: torch.optim.AdamW(p)}
    return profile_step(
        lambda: _build(lightning), batch, mode=mode, precision=precision, steps=2, prepare_model=prepare, **options
    )


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, (lightning, precision, checkpointed) in CASES.items():
        measured = _profile(lightning, precision, checkpointed, "real", world)
        if rank == 0:
            unsharded = from_profile(_profile(lightning, precision, checkpointed, "fake"))
            predicted = sharded_estimate(unsharded, ShardedModel.of(_build(lightning)), Sharding(world), precision)
            print(f"step {name} {measured.peak_bytes} {predicted.peak_bytes}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    mp.spawn(run, args=(2, free_port), nprocs=2)
