"""Two CPU ranks (gloo), launched like torchrun, train under DDP and fsdp_memopt, one fit after another.

python tests/strategies/fsdp_run.py OUT_DIR          # writes OUT_DIR/rank{0,1}.pt
python tests/strategies/fsdp_run.py OUT_DIR single   # one rank: cpu_offload at devices=1 -> OUT_DIR/single.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.callbacks import LastCheckpoint
from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataset
from lightning_memopt.strategies import MemoptFSDPStrategy
from lightning_memopt.tasks import NormalEstimationModule
from tests.helpers import quiet_trainer
from tests.strategies.strategies_ddp_run import MLP, Block, Indexed, data


class Losses(pl.Callback):
    """Each step's loss and batch, and each rank's count of the parameters' elements it holds after the fit."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list = []
        self.local_elements = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())
        self.batches.append(batch)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.local_elements = sum(_local(p).numel() for p in pl_module.parameters())


class Steps(pl.Callback):
    """Every parameter's gradient before each optimizer step and its value after the step, whole."""

    def __init__(self) -> None:
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.parameters: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.gradients.append({name: _whole(p.grad) for name, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.parameters.append(full_parameters(pl_module))


class PlainSGD(MLP):
    """SGD without momentum: no state carries a step's error on, and no scale invariance (Adam's) hides one."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NineIndexed(Indexed):
    """Validation: 9 samples, batches of 4: 5 and 4 samples, 2 and 1 batches if nothing were repeated."""

    def _build_datasets(self):
        return data().dataset, TensorDataset(torch.arange(9.0)[:, None].expand(9, 32), torch.zeros(9, 4))


class Evaluated(MLP):
    def validation_step(self, batch, batch_idx):
        self.net(batch[0])  # gathers the units with the other rank
        super().validation_step(batch, batch_idx)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` whole (a sharded one gathered from the ranks)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole."""
    return {name: _whole(p) for name, p in module.named_parameters()}


def normals() -> tuple[NormalEstimationModule, DataLoader]:
    torch.manual_seed(0)
    module = NormalEstimationModule(backbone="sapiens_tiny", lr=2e-3, warmup_steps=0, schedule="constant")
    return module, DataLoader(SyntheticNormalsDataset(16, (64, 48), seed=0), batch_size=2)


def fit(strategy, steps, module=None, loader=None, devices=2, **options):
    module = MLP() if module is None else module
    recorder = Losses()
    callbacks = [recorder, *options.pop("callbacks", [])]
    ckpt_path = options.pop("ckpt_path", None)
    trainer = quiet_trainer(strategy=strategy, devices=devices, max_steps=steps, callbacks=callbacks, **options)
    trainer.fit(module, data() if loader is None else loader, ckpt_path=ckpt_path)
    return module, trainer, recorder


def run(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    result = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp", "fsdp_memopt"), ("offload", MemoptFSDPStrategy(cpu_offload=True))):
        module, trainer, recorder = fit(strategy, 6, gradient_clip_val=0.5)
        result[name] = recorder.losses
        result[f"{name}/elements"] = recorder.local_elements
        result[f"{name}/parameters"] = full_parameters(module)
    result["fsdp/units"] = trainer.strategy.units
    _, _, recorder = fit("fsdp_memopt", 6, gradient_clip_val=0.5, callbacks=[ActivationCheckpointing(policy=[Block])])
    result["checkpointed"] = recorder.losses
    for name in ("ddp", "fsdp_memopt"):
        module, loader = normals()
        _, trainer, recorder = fit(name, 4, module, loader)
        result[f"normals/{name}"] = recorder.losses
    trainer.save_checkpoint(f"{out_dir}/normals.ckpt")  # fsdp_memopt's folder of shards
    result["normals/elements"] = sum(p.numel() for p in normals()[0].parameters())

    # no clipping, plain SGD, each rank and step a batch of its own: a gradient scaled wrong shows at every step
    for name in ("ddp", "fsdp_memopt"):
        steps = Steps()
        _, _, recorder = fit(name, 4, PlainSGD(), callbacks=[steps])
        result[f"steps/{name}"] = {"gradients": steps.gradients, "parameters": steps.parameters}
    result["steps/batches"] = recorder.batches

    # one epoch of 6 shuffled batches straight, and 3 saved on the step boundary (LastCheckpoint) then resumed
    # mid-epoch to 6, from the folder of shards and from one file, on the resumable loader of the datamodules
    module, _, recorder = fit("fsdp_memopt", 6, loader=Indexed(batch_size=8), limit_val_batches=0)
    result["straight"], result["straight/losses"] = full_parameters(module), recorder.losses
    result["straight/batches"] = recorder.batches
    for layout, distributed in (("sharded", True), ("full", False)):
        path = f"{out_dir}/{layout}.ckpt"
        strategy = MemoptFSDPStrategy(save_distributed_checkpoint=distributed)
        last = LastCheckpoint(out_dir, f"{layout}.ckpt")
        module, _, _ = fit(strategy, 3, loader=Indexed(batch_size=8), limit_val_batches=0, callbacks=[last])
        result[f"saved/{layout}"] = full_parameters(module)
        strategy = MemoptFSDPStrategy(save_distributed_checkpoint=distributed)
        module, _, recorder = fit(strategy, 6, loader=Indexed(batch_size=8), limit_val_batches=0, ckpt_path=path)
        result[f"resumed/{layout}"] = full_parameters(module)
        result[f"resumed/{layout}/losses"] = recorder.losses
        result[f"resumed/{layout}/batches"] = recorder.batches
    validated = Evaluated()
    quiet_trainer(strategy="fsdp_memopt", devices=2).validate(validated, datamodule=NineIndexed(batch_size=4))
    result["validation_seen"] = validated.seen
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def single(out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = {}
    for name, strategy in (("plain", "auto"), ("offload", MemoptFSDPStrategy(cpu_offload=True))):
        module, _, recorder = fit(strategy, 6, devices=1, use_distributed_sampler=False)
        result[name] = recorder.losses
        result[f"{name}/parameters"] = full_parameters(module)
    torch.save(result, f"{out_dir}/single.pt")


if __name__ == "__main__":
    port = 29500 + os.getpid() % 1000
    if sys.argv[2:] == ["single"]:
        single(sys.argv[1], port)
    else:
        mp.spawn(run, args=(sys.argv[1], port), nprocs=2)
