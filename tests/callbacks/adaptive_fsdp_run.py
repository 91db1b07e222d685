"""Two CPU ranks (gloo): whole batches under DDP, then planned micro-batches of 4 under fsdp_memopt.

python tests/callbacks/adaptive_fsdp_run.py OUT_DIR      # writes OUT_DIR/rank{0,1}.pt

Both runs see the same data and accumulate two batches per optimizer step, so equal losses,
gradients and parameters mean the micro-batches' reduce-scattered gradients reached the shards once.
"""

import sys

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_memopt import AdaptiveAccumulation
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.callbacks.test_adaptive_accumulation import OOMToy
from tests.helpers import quiet_trainer


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from the ranks' shards under FSDP (a collective every rank calls)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class StepRecorder(pl.Callback):
    """Each batch's loss and each optimizer step's full gradients."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([full(p.grad) for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def train(strategy, callbacks=()):
    module, recorder = OOMToy(), StepRecorder()
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=3, accumulate_grad_batches=2,
                            callbacks=[recorder, *callbacks], limit_val_batches=0)  # fmt: skip
    trainer.fit(module)
    result = {"losses": recorder.losses, "grads": recorder.grads, "params": [full(p) for p in module.parameters()]}
    return result, trainer


def main(out_dir: str) -> None:
    ddp, _ = train("ddp")
    callback = AdaptiveAccumulation(micro_batch_size=4)
    fsdp, trainer = train(MemoptFSDPStrategy(), [callback])
    fsdp["micro_batches"] = callback.last_micro_batches
    torch.save({"ddp": ddp, "fsdp": fsdp}, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
