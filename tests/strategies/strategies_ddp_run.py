"""Two CPU ranks (gloo), launched like torchrun, train a small MLP under each DDP preset, one fit after another.

python tests/strategies/strategies_ddp_run.py OUT_DIR      # writes OUT_DIR/rank{0,1}.pt
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.data.loader_datamodule import LoaderDataModule
from lightning_memopt.strategies import POWERSGD_KEY, MemoptDDPStrategy
from tests.helpers import quiet_trainer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Indexed(LoaderDataModule):
    """Training batches of the regression data; validation: the 11 sample indices themselves."""

    def _build_datasets(self):
        return data().dataset, TensorDataset(torch.arange(11.0)[:, None].expand(11, 32), torch.zeros(11, 4))


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 48), Block(48), Block(48), nn.Linear(48, 4))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.seen.extend(batch[0][:, 0].long().tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(96, 32, generator=generator), torch.randn(96, 4, generator=generator)),
                      batch_size=8)  # fmt: skip


def one_batch() -> DataLoader:
    """The same 8 samples every step on both ranks: Lightning's resume at a step count that ends an epoch
    replays a batch, so the PowerSGD resume runs use data that no replay can change."""
    return DataLoader(TensorDataset(*(tensor[:8] for tensor in data().dataset.tensors)), batch_size=8)


def fit(strategy, steps: int, callbacks=(), ckpt_path=None, save_to=None, loader=None) -> tuple[MLP, pl.Trainer]:
    module = MLP()
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=steps, callbacks=list(callbacks),
                            use_distributed_sampler=loader is None)  # fmt: skip
    trainer.fit(module, data() if loader is None else loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module, trainer


def params(module: MLP) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def run(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    result = {}
    for name in ("ddp", "ddp_memopt", "ddp_fp16_compress", "ddp_bf16_compress"):
        module, trainer = fit(name, 6)
        result[name] = params(module)
        result[f"{name}/strategy"] = type(trainer.strategy).__name__
    lossless = MemoptDDPStrategy(comm_hook="powersgd", powersgd_rank=64, powersgd_warmup=2)
    result["powersgd_lossless"] = params(fit(lossless, 6)[0])
    module, trainer = fit(MemoptDDPStrategy(comm_hook="powersgd", powersgd_warmup=2), 12, loader=one_batch())
    state = trainer.strategy.comm_state
    result["powersgd"] = params(module)
    result["powersgd/compressed"] = (
        state.iter,
        state.total_numel_before_compression,
        state.total_numel_after_compression,
    )
    first_half = f"{out_dir}/half.ckpt"
    fit(MemoptDDPStrategy(comm_hook="powersgd", powersgd_warmup=2), 6, save_to=first_half, loader=one_batch())
    resumed = fit(MemoptDDPStrategy(comm_hook="powersgd", powersgd_warmup=2), 12, ckpt_path=first_half,
                  loader=one_batch())[0]  # fmt: skip
    result["powersgd_resumed"] = params(resumed)
    checkpoint = torch.load(first_half, weights_only=True)
    result["checkpoint_states"] = len(checkpoint[POWERSGD_KEY])
    if rank == 0:  # the same checkpoint without PowerSGD's state
        del checkpoint[POWERSGD_KEY]
        torch.save(checkpoint, f"{out_dir}/stripped.ckpt")
    torch.distributed.barrier()
    stripped = fit(MemoptDDPStrategy(comm_hook="powersgd", powersgd_warmup=2), 12, ckpt_path=f"{out_dir}/stripped.ckpt",
                   loader=one_batch())  # fmt: skip
    result["powersgd_stripped"] = params(stripped[0])
    module, trainer = fit("ddp_memopt", 6, callbacks=[ActivationCheckpointing(policy=[Block])])
    result["checkpointed"] = params(module)
    result["checkpointed/static_graph"] = trainer.strategy._ddp_kwargs["static_graph"]
    validated = MLP()
    quiet_trainer(strategy="ddp_memopt", devices=2).validate(validated, datamodule=Indexed(batch_size=4))
    result["validation_seen"] = validated.seen
    torch.save(result, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], 29500 + os.getpid() % 1000), nprocs=2)
