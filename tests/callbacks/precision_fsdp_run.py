"""Two CPU ranks (gloo) under PrecisionSwitch: DDP, then fsdp_memopt; steps skipped and precisions switched together.

python tests/callbacks/precision_fsdp_run.py OUT_DIR     # writes OUT_DIR/rank{0,1}.pt

32-true, then bf16-mixed from step 2, with the fail-safe and gradient clipping: a NaN loss on rank 1
only at step 3, and a NaN written into rank 0's own gradient (its shard under FSDP) at step 4. Then
16-mixed under fsdp_memopt without the fail-safe, with an inf in rank 0's shard at step 3.
"""

import sys

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_memopt import PrecisionSwitch
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.callbacks.adaptive_fsdp_run import full
from tests.callbacks.test_precision_switch import Toy
from tests.helpers import quiet_trainer


class Faulty(Toy):
    """A NaN loss on rank 1 at ``nan_loss_step``; ``bad_value`` in rank 0's own gradient at ``bad_grad_step``."""

    def __init__(self, nan_loss_step=None, bad_grad_step=None, bad_value=float("nan")):
        super().__init__(faults=lambda step, rank: "nan_loss" if (step, rank) == (nan_loss_step, 1) else None)
        self.bad_grad_step, self.bad_value = bad_grad_step, bad_value

    def on_after_backward(self):
        if (self.trainer.global_step, self.global_rank) == (self.bad_grad_step, 0):
            grad = self.net[0].weight.grad
            (grad.to_local() if isinstance(grad, DTensor) else grad)[0, 0] = self.bad_value


class StepRecorder(pl.Callback):
    """Each step's loss, then the full parameters and the loss scale after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: list[list[torch.Tensor]] = []
        self.scales: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.params.append([full(p) for p in pl_module.parameters()])
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else None)


def train(strategy, module, switch, max_steps, **options):
    recorder = StepRecorder()
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=max_steps, callbacks=[switch, recorder], **options)
    trainer.fit(module)
    plugin = trainer.precision_plugin
    result = {
        "losses": recorder.losses,
        "params": recorder.params,
        "scales": recorder.scales,
        "history": plugin.history,
        "skipped_steps": plugin.skipped_steps,
        "dtypes": module.dtypes(),
    }
    return result, trainer


def main(out_dir: str) -> None:
    result = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", MemoptFSDPStrategy())):
        module = Faulty(nan_loss_step=3, bad_grad_step=4)
        switch = PrecisionSwitch("32-true", schedule={2: "bf16-mixed"}, fail_safe=True)
        result[name], _ = train(strategy, module, switch, max_steps=6, gradient_clip_val=0.5)
    module = Faulty(bad_grad_step=3, bad_value=float("inf"))
    result["fsdp16"], trainer = train(MemoptFSDPStrategy(), module, PrecisionSwitch("16-mixed"), max_steps=5)
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
