"""``memopt-train``: compose the config tree with Hydra and run a Lightning fit.

Examples (shell)::

    memopt-train                                   # r18 on synthetic faces, CPU, bounded steps
    memopt-train model=r100 strategy=ddp trainer=gpu trainer.devices=4
    memopt-train -m data.batch_size=32,64 trainer.max_steps=10
"""

from __future__ import annotations

import sys

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from lightning_memopt.accumulation import SampleOutOfMemoryError
from lightning_memopt.callbacks.training_summary import FitSummary, TrainingSummary
from lightning_memopt.cli.config import config_dir, instantiate_named
from lightning_memopt.memory.allocator import configure_allocator


def check_launch_fits_hydra_mode(trainer: pl.Trainer) -> None:
    """Refuse a multirun whose jobs would start DDP worker processes by re-running the command line.

    Lightning's ``ddp`` launcher starts ranks 1… by re-executing ``sys.argv``; in a Hydra multirun
    each of those processes would start the whole sweep again in its own directory. Processes
    started by the cluster (``torchrun``, SLURM) and ``ddp_spawn`` are fine.

    Raises:
        MisconfigurationException: for a multirun with a multi-process ``ddp`` launch.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    strategy = trainer.strategy
    launcher = getattr(strategy, "launcher", None)
    relaunches_argv = type(launcher).__name__ == "_SubprocessScriptLauncher"
    cluster = getattr(strategy, "cluster_environment", None)
    if relaunches_argv and trainer.world_size > 1 and not (cluster and cluster.creates_processes_externally):
        raise MisconfigurationException(
            f"`strategy=ddp` with {trainer.world_size} processes cannot run inside a Hydra multirun (-m): its "
            "worker processes re-run the command line and would start the sweep again. Use "
            "`trainer.strategy=ddp_spawn`, launch each job with torchrun, or sweep with a cluster launcher "
            "(hydra/launcher=slurm)."
        )


def train(cfg: DictConfig) -> FitSummary:
    """Build data, model, callbacks, loggers and Trainer from ``cfg`` and fit.

    Returns:
        The run's :class:`FitSummary` (also printed).
    """
    configure_allocator(**cfg.memopt.get("allocator", {}))
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    summary = TrainingSummary(csv_path=cfg.get("results_csv"), label=" ".join(overrides))
    callbacks = instantiate_named(cfg.get("callbacks"), "callbacks")
    callbacks += instantiate_named(cfg.memopt.get("callbacks"), "memopt.callbacks")
    loggers = instantiate_named(cfg.get("logger"), "logger")
    trainer = instantiate(cfg.trainer, callbacks=[*callbacks, summary], logger=loggers or False)
    check_launch_fits_hydra_mode(trainer)
    rank_zero_info(f"memopt-train: model={type(model).__name__} data={type(datamodule).__name__}")
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    return summary.summary


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the final training loss (the value Hydra sweepers optimise).

    A configuration that cannot run (a MisconfigurationException: a bad argument, a plan that fits
    nothing), a constructor's ValueError (a bad option, a pretrained file that does not match the model),
    a missing file, or a step that does not fit even in the smallest micro-batch ends the job with its
    reason on stderr and exit status 2, without a traceback.
    """
    try:
        return train(cfg).final_loss
    except (MisconfigurationException, SampleOutOfMemoryError) as error:
        print(f"memopt-train: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except InstantiationException as error:
        # Hydra wraps what a constructor raises. Constructors raise ValueError for a bad argument (its name, value
        # and the valid choices; a pretrained file that does not match is one too; callbacks and strategies a
        # MisconfigurationException) and FileNotFoundError for a missing file: input errors, whose own message is
        # the whole story.
        if not isinstance(error.__cause__, (ValueError, FileNotFoundError, MisconfigurationException)):
            raise
        print(f"memopt-train: {error.__cause__}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
