"""``memopt-train``: compose the config tree with Hydra and run a Lightning fit.

Examples (shell)::

    memopt-train                                   # r18 on synthetic faces, CPU, bounded steps
    memopt-train model=r100 strategy=ddp trainer=gpu trainer.devices=4
    memopt-train -m data.batch_size=32,64 trainer.max_steps=10
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_memopt.arguments import check_bool, check_float, check_int, check_output_file
from lightning_memopt.cli.config import config_dir, instantiate_named, route_lightning_logs
from lightning_memopt.cli.errors import EXIT_INTERRUPTED, input_errors, run_hydra_app, task_started

# torch and Lightning are imported once a run starts (in the functions below), not with this module:
# `memopt-train --help`, `--cfg job` and shell completion then answer at once.
if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_memopt.callbacks.training_summary import FitSummary, TrainingSummary
    from lightning_memopt.cli.objective import Objective


def check_launch_fits_hydra_mode(trainer: pl.Trainer) -> None:
    """Refuse a multirun whose jobs would start DDP worker processes by re-running the command line.

    Lightning's ``ddp`` launcher starts ranks 1… by re-executing ``sys.argv``; in a Hydra multirun
    each of those processes would start the whole sweep again in its own directory. Processes
    started by the cluster (``torchrun``, SLURM) and ``ddp_spawn`` are fine.

    Raises:
        MisconfigurationException: for a multirun with a multi-process ``ddp`` launch.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

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


# Trainer options Lightning takes without checking their type: (kind, minimum) for each
_TRAINER_INTS = {
    "max_epochs": -1,
    "max_steps": -1,
    "min_epochs": 0,
    "min_steps": 0,
    "log_every_n_steps": 1,
    "accumulate_grad_batches": 1,
    "num_sanity_val_steps": -1,
    "check_val_every_n_epoch": 1,
    "num_nodes": 1,
}
_TRAINER_BOOLS = (
    "enable_checkpointing",
    "enable_progress_bar",
    "enable_model_summary",
    "benchmark",
    "inference_mode",
    "use_distributed_sampler",
    "sync_batchnorm",
    "detect_anomaly",
    "barebones",
)
_TRAINER_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def check_trainer_options(trainer: DictConfig) -> None:
    """Check the ``trainer.*`` values Lightning takes without checking their kind, and write them back typed.

    Lightning would read ``trainer.detect_anomaly=no`` as true (a non-empty string) and fail later,
    obscurely, on ``trainer.max_steps=abc``.

    Raises:
        TypeError, ValueError: naming ``trainer.<key>`` and the value.
    """
    checked: dict[str, object] = {}
    for key, minimum in _TRAINER_INTS.items():
        if trainer.get(key) is not None:
            checked[key] = check_int(f"trainer.{key}", trainer[key], minimum=minimum)
    for key in _TRAINER_BOOLS:
        if trainer.get(key) is not None:
            checked[key] = check_bool(f"trainer.{key}", trainer[key])
    for key in _TRAINER_LIMITS:
        value = trainer.get(key)
        if isinstance(value, float) and value <= 1.0:  # a fraction of the batches
            checked[key] = check_float(f"trainer.{key}", value, minimum=0.0)
        elif value is not None:  # a count (10.0 from YAML too)
            checked[key] = check_int(f"trainer.{key}", value, minimum=0)
    if trainer.get("gradient_clip_val") is not None:
        checked["gradient_clip_val"] = check_float("trainer.gradient_clip_val", trainer.gradient_clip_val, minimum=0.0)
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices != "auto" and not devices.replace(",", "").replace("-", "").isdigit():
        raise ValueError(
            f"`trainer.devices` must be 'auto', a count (-1: all), a list of device indices or a string such as"
            f" '0,1', got {devices!r}"
        )
    with open_dict(trainer):
        trainer.update(checked)


# `ckpt_path` values Lightning resolves itself: the last or best checkpoint of the run, SLURM's
_LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")


def resolve_checkpoint_path(path: object) -> object:
    """``ckpt_path`` checked when it is a local path (``last``, ``best``, URLs go to Lightning as they are)."""
    if isinstance(path, str) and (path in _LIGHTNING_CHECKPOINT_NAMES or "://" in path):
        return path
    from lightning_memopt.strategies.consolidate import check_checkpoint

    return check_checkpoint("ckpt_path", path)


@dataclass
class Run:
    """What :func:`build_run` makes of a config: everything ``Trainer.fit`` takes."""

    trainer: pl.Trainer
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    ckpt_path: object
    summary: TrainingSummary
    objective: Objective | None = None


def build_run(cfg: DictConfig) -> Run:
    """Check ``cfg``'s top-level keys and build data, model, callbacks, loggers and Trainer from it."""
    import lightning.pytorch as pl

    import lightning_memopt.strategies  # noqa: F401  (registers `trainer.strategy=ddp_memopt`, `fsdp_memopt`, …)
    from lightning_memopt.callbacks.training_summary import TrainingSummary
    from lightning_memopt.cli.objective import check_sweeper_direction, resolve_objective
    from lightning_memopt.cli.plan_ahead import plan_ahead
    from lightning_memopt.memory.allocator import configure_allocator

    ckpt_path = None if cfg.get("ckpt_path") is None else resolve_checkpoint_path(cfg.ckpt_path)
    check_trainer_options(cfg.trainer)
    configure_allocator(**cfg.memopt.get("allocator", {}))
    if cfg.get("seed") is not None:
        pl.seed_everything(check_int("seed", cfg.seed), workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    objective = resolve_objective(cfg.get("objective", "auto"), model)
    if HydraConfig.initialized():  # an optimising sweeper (sweep=optuna) must go the objective's way
        check_sweeper_direction(objective, HydraConfig.get().sweeper.get("direction"))
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    results_csv = cfg.get("results_csv")
    if results_csv is not None:  # checked here to name the key the user set
        results_csv = check_output_file("results_csv", results_csv)
    summary = TrainingSummary(csv_path=results_csv, label=" ".join(overrides), print_summary=True)
    callbacks = instantiate_named(cfg.get("callbacks"), "callbacks")
    callbacks += instantiate_named(cfg.memopt.get("callbacks"), "memopt.callbacks")
    callbacks += planned_knobs(cfg.get("knobs"), callbacks)
    callbacks += compile_callbacks(check_bool("compile", cfg.get("compile", False)), callbacks)
    plan_ahead(callbacks, model, datamodule, cfg.trainer)  # memopt=auto: MemoryBudget plans before the Trainer exists
    loggers = instantiate_named(cfg.get("logger"), "logger")
    trainer = instantiate(cfg.trainer, callbacks=[*callbacks, summary], logger=loggers or False)
    check_launch_fits_hydra_mode(trainer)
    return Run(trainer, model, datamodule, ckpt_path, summary, objective)


def planned_knobs(knobs: object, callbacks: list) -> list:
    """What ``knobs={…}`` (a plan's knobs, as ``memopt-plan`` prints them) adds: the MemoryBudget that applies them.

    Raises:
        ValueError: a MemoryBudget of the ``memopt`` bundle is there too (it plans or applies knobs of its own).
    """
    from lightning_memopt.callbacks import MemoryBudget

    if knobs is None:
        return []
    if any(isinstance(callback, MemoryBudget) for callback in callbacks):
        raise ValueError(
            "`knobs` apply a plan, and the `memopt` bundle has a MemoryBudget of its own: give `knobs` with "
            "memopt=none (or monitor, adaptive, …), or drop `knobs`"
        )
    values = OmegaConf.to_container(knobs) if isinstance(knobs, DictConfig) else knobs
    return [MemoryBudget(knobs=values)]


def compile_callbacks(compile_model: bool, callbacks: list) -> list:
    """What ``compile=true`` adds: nothing where a MemoryBudget is there (it weighs compiling, or, given knobs
    without a ``compile_budget``, applies them compiled at torch's default budget), else a CompiledStep at that
    budget."""
    from dataclasses import replace

    from lightning_memopt.callbacks import CompiledStep, MemoryBudget

    if not compile_model:
        return []
    budgets = [callback for callback in callbacks if isinstance(callback, MemoryBudget)]
    for budget in budgets:
        budget.compile = True
        if budget.knobs is not None and budget.knobs.compile_budget is None:
            budget.knobs = replace(budget.knobs, compile_budget=1.0)
    return [] if budgets else [CompiledStep(1.0)]


def fit(run: Run) -> FitSummary:
    """Fit a built run.

    Returns:
        The run's :class:`FitSummary` (also printed).

    Raises:
        KeyboardInterrupt: the fit was stopped with Ctrl-C (after ``last.ckpt`` was saved).
    """
    from lightning.pytorch.utilities import rank_zero_info

    from lightning_memopt.callbacks.resume import LastCheckpoint
    from lightning_memopt.cli.config import finish_logger_runs

    rank_zero_info(f"memopt-train: model={type(run.model).__name__} data={type(run.datamodule).__name__}")
    last_checkpoints = [callback for callback in run.trainer.callbacks if isinstance(callback, LastCheckpoint)]
    exit_code = 1  # what the W&B run is marked with unless the fit returns
    try:
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
        exit_code = 0
    except SystemExit:  # Lightning ends a fit stopped by a (second) Ctrl-C with status 1
        if any(callback.stop_requested for callback in last_checkpoints):
            raise KeyboardInterrupt from None
        raise
    finally:
        finish_logger_runs(run.trainer.loggers, exit_code)  # the next job of a multirun logs a W&B run of its own
    if any(callback.interrupted for callback in last_checkpoints):
        raise KeyboardInterrupt
    return run.summary.summary


def job_result(run: Run) -> float | None:
    """The value of the run's ``objective`` after its fit, said on rank 0 (``None``: no objective, or none logged).

    Raises:
        InputError: an ``objective=`` metric the fit never logged (the message lists those it did).
    """
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_memopt.cli.objective import objective_value

    value = objective_value(run.objective, run.trainer.callback_metrics)
    if value is not None:
        assert run.objective is not None
        rank_zero_info(f"memopt-train: objective {run.objective.describe(value)}")
    elif run.objective is not None:
        rank_zero_warn(
            f"memopt-train: `objective=auto` is {run.objective.metric}, which this fit never logged (no validation"
            " ran), so the job returns nothing to a sweeper (an optimising one such as sweep=optuna stops there);"
            " name a logged metric (`objective=train/loss`) or `objective=null`"
        )
    return value


def train(cfg: DictConfig) -> FitSummary:
    """Build the run of ``cfg`` and fit it; see :func:`build_run` and :func:`fit`."""
    return fit(build_run(cfg))


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _train_app(cfg: DictConfig) -> float | None:
    """Hydra task: fit ``cfg``; returns the value of ``objective`` (what Hydra sweepers optimise)."""
    task_started()
    route_lightning_logs()
    with input_errors("memopt-train", building=True, config=cfg):
        run = build_run(cfg)
    with input_errors("memopt-train", config=cfg):
        try:
            summary = fit(run)
            value = job_result(run)
            _keep_job_summary(run, summary, value)
            return value
        except KeyboardInterrupt:
            print("memopt-train: stopped by Ctrl-C", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INTERRUPTED) from None


def _keep_job_summary(run: Run, summary: FitSummary, value: float | None) -> None:
    """In a multirun, rank 0 writes the job's figures for the table the sweep ends with (``MultirunTable``)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN or run.trainer.global_rank != 0:
        return
    from lightning_memopt.cli.multirun_table import write_job_summary

    objective = run.objective.describe(value) if run.objective is not None and value is not None else ""
    hydra = HydraConfig.get()
    write_job_summary(hydra.runtime.output_dir, list(hydra.overrides.task), summary, objective)


def main() -> None:
    """``memopt-train``: exit status 0 when done, 2 for a bad input (one line, no traceback; ``--debug`` shows
    it), 130 when stopped with Ctrl-C, 1 for an unexpected error (see :mod:`lightning_memopt.cli.errors`)."""
    run_hydra_app("memopt-train", _train_app, config_name="train")


if __name__ == "__main__":
    main()
