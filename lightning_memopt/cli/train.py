"""``memopt-train``: compose the config tree with Hydra and run a Lightning fit.

Examples (shell)::

    memopt-train                                   # r18 on synthetic faces, CPU, bounded steps
    memopt-train model=r100 strategy=ddp trainer=gpu trainer.devices=4
    memopt-train -m data.batch_size=32,64 trainer.max_steps=10
"""

from __future__ import annotations

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from lightning_memopt.callbacks.training_summary import FitSummary, TrainingSummary
from lightning_memopt.cli.config import config_dir, instantiate_named


def train(cfg: DictConfig) -> FitSummary:
    """Build data, model, callbacks, loggers and Trainer from ``cfg`` and fit.

    Returns:
        The run's :class:`FitSummary` (also printed).
    """
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    summary = TrainingSummary()
    callbacks = instantiate_named(cfg.get("callbacks"), "callbacks")
    callbacks += instantiate_named(cfg.memopt.get("callbacks"), "memopt.callbacks")
    loggers = instantiate_named(cfg.get("logger"), "logger")
    trainer = instantiate(cfg.trainer, callbacks=[*callbacks, summary], logger=loggers or False)
    rank_zero_info(f"memopt-train: model={type(model).__name__} data={type(datamodule).__name__}")
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    return summary.summary


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the final training loss (the value Hydra sweepers optimise)."""
    return train(cfg).final_loss


if __name__ == "__main__":
    main()
