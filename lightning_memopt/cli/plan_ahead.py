"""``memopt-train memopt=auto``: plan the run before its Trainer exists, from the model and data already built.

:class:`~lightning_memopt.MemoryBudget` plans in ``setup`` when used with a Trainer of one's own;
``memopt-train`` has the model and the datamodule before it builds the Trainer, so it plans there,
for the run its ``trainer`` config describes (:func:`run_target`), and ``setup`` applies the plan.
Under DDP each rank's process builds the run again: only rank 0 plans, and in ``setup`` every rank
takes rank 0's knobs (or its reason that nothing fits), as when planning in ``setup``.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig

from lightning_memopt.arguments import check_bool
from lightning_memopt.cli.plan_config import training_batch
from lightning_memopt.vocabulary import PRECISION_ALIASES


def plan_ahead(callbacks: list[Any], model: Any, datamodule: Any, trainer: DictConfig) -> None:
    """Plan each :class:`~lightning_memopt.MemoryBudget` of ``callbacks`` given no ``knobs``, for the run of the
    ``trainer`` config, on ``model`` and the first training batch of ``datamodule`` (on rank 0 only).

    Example::

        >>> from omegaconf import OmegaConf
        >>> plan_ahead([], None, None, OmegaConf.create({"devices": 1}))   # no MemoryBudget: nothing to plan
    """
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_memopt.callbacks import MemoryBudget

    budgets = [c for c in callbacks if isinstance(c, MemoryBudget) and c.knobs is None]
    if not budgets or rank_zero_only.rank != 0:  # other ranks take rank 0's plan in setup
        return
    target = run_target(trainer)
    if target["device"].type == "cuda" and _starts_by_fork(trainer.get("strategy", "auto")):
        return  # querying the GPU here would start CUDA, and a forked rank cannot use it: setup plans instead
    batch = None
    for budget in budgets:
        if budget.sample_batch is None and batch is None:
            batch = training_batch(datamodule)
        budget.plan_ahead(model, budget.sample_batch if budget.sample_batch is not None else batch, **target)


def run_target(trainer: DictConfig) -> dict[str, Any]:
    """What a composed ``trainer`` config will run, as :meth:`~lightning_memopt.MemoryBudget.plan_ahead` takes it:
    the world size, whether the strategy is ``fsdp_memopt`` (and given ``cpu_offload``), the Trainer's precision and
    the device rank 0 trains on. (``setup`` plans again should the Trainer turn out otherwise.)

    Example::

        >>> from omegaconf import OmegaConf
        >>> strategy = {"_target_": "lightning_memopt.strategies.MemoptFSDPStrategy", "cpu_offload": True}
        >>> cfg = {"accelerator": "cpu", "devices": 2, "num_nodes": 1, "precision": "bf16", "strategy": strategy}
        >>> run_target(OmegaConf.create(cfg))
        {'devices': 2, 'fsdp': True, 'cpu_offload': True, 'precision': 'bf16-mixed', 'device': device(type='cpu')}
    """
    import torch

    accelerator = str(trainer.get("accelerator", "auto"))
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    indices = _device_indices(trainer.get("devices", "auto"), cuda)
    fsdp, cpu_offload = _fsdp_memopt(trainer.get("strategy", "auto"))
    precision = str(trainer.get("precision", "32-true"))
    return {
        "devices": len(indices) * int(trainer.get("num_nodes", 1)),
        "fsdp": fsdp,
        "cpu_offload": cpu_offload,
        "precision": PRECISION_ALIASES.get(precision, precision),
        "device": torch.device("cuda", indices[0]) if cuda else torch.device("cpu"),
    }


def _device_indices(devices: Any, cuda: bool) -> list[int]:
    """The devices ``Trainer(devices=...)`` takes (a count, -1 or ``"auto"`` for all, a list or ``"0,1"`` of indices);
    off CUDA ``"auto"`` is one process."""
    import torch

    if isinstance(devices, ListConfig | list | tuple):
        return [int(index) for index in devices]
    text = str(devices).strip()
    if "," in text:
        return [int(index) for index in text.split(",") if index.strip()]
    every = torch.cuda.device_count() if cuda else os.cpu_count() or 1
    count = (every if cuda else 1) if text == "auto" else int(text)
    return list(range(every if count == -1 else count))


def _fsdp_memopt(strategy: Any) -> tuple[bool, bool]:
    """Whether ``strategy`` (a config with ``_target_``, or a registered name) is ``fsdp_memopt``, and given
    ``cpu_offload``."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_memopt.registration import registered_class
    from lightning_memopt.strategies import MemoptFSDPStrategy

    if isinstance(strategy, DictConfig) and "_target_" in strategy:
        kind, options = get_class(strategy._target_), strategy
    elif isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        kind, options = registered_class(entry["strategy"]), entry["init_params"]
    else:
        return False, False
    fsdp = isinstance(kind, type) and issubclass(kind, MemoptFSDPStrategy)
    return fsdp, fsdp and check_bool("trainer.strategy.cpu_offload", options.get("cpu_offload", False))


def _starts_by_fork(strategy: Any) -> bool:
    """Whether ``strategy`` (a config with ``_target_``, or a registered name) starts its ranks by forking this
    process (``ddp_fork``, ``ddp_notebook``), which CUDA must not have been started in."""
    from lightning.pytorch.strategies import StrategyRegistry

    if isinstance(strategy, DictConfig):
        return str(strategy.get("start_method", "popen")) == "fork"
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        return str(StrategyRegistry[strategy]["init_params"].get("start_method", "popen")) == "fork"
    return False
