"""What :class:`~lightning_memopt.MemoryBudget` plans for (the run's ranks, strategy, precision and device), how
it plans for it, and what it says when nothing fits."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_memopt.planner import Hardware, Knobs, Plan, PlanError, cuda_hardware, gpu, measure_cpu, plan
from lightning_memopt.planner import with_budget as budget_of
from lightning_memopt.planner.knobs import train_command
from lightning_memopt.strategies import MemoptFSDPStrategy
from lightning_memopt.vocabulary import GIB


@dataclass(frozen=True)
class PlanTarget:
    """The run a plan is for: ``devices`` ranks under ``fsdp_memopt`` (``fsdp``; with ``cpu_offload`` given to it, so
    offloaded plans only) or not, the mixed ``precision`` the Trainer runs itself (``None``: ``"32-true"``, and
    PrecisionSwitch applies the plan's) and the ``device`` rank 0 trains on.

    Example::

        >>> PlanTarget(4, fsdp=True, precision="bf16-mixed").describe()
        '4 ranks, fsdp_memopt, the Trainer at bf16-mixed, on cpu'
    """

    devices: int = 1
    fsdp: bool = False
    cpu_offload: bool = False
    precision: str | None = None
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, trainer: Trainer, pl_module: LightningModule) -> PlanTarget:
        """The run of ``trainer``, in its ``setup`` hooks: the strategy's root device is the one rank 0 trains on
        (``pl_module`` is still on the CPU there; the strategy moves it after ``setup``)."""
        strategy = trainer.strategy
        fsdp = isinstance(strategy, MemoptFSDPStrategy)
        offload = fsdp and bool(strategy.cpu_offload)  # type: ignore[attr-defined]
        return cls(trainer.world_size, fsdp, offload, trainer_precision(trainer), strategy.root_device)

    def describe(self) -> str:
        parts = [f"{self.devices} rank{'s' if self.devices > 1 else ''}"]
        parts += ["fsdp_memopt" + (" with CPU offload" if self.cpu_offload else "")] if self.fsdp else []
        parts += [f"the Trainer at {self.precision}"] if self.precision is not None else []
        return ", ".join(parts) + f", on {self.device}"


@dataclass(frozen=True)
class PlanOutcome:
    """Rank 0's planning for ``target``: the knobs (as a dict, to broadcast to every rank), or why there are none."""

    target: PlanTarget
    knobs: dict[str, Any] | None
    failure: str = ""
    cause: BaseException | None = None  # what made planning fail (re-raised on rank 0 as the cause)

    @classmethod
    def failed(cls, target: PlanTarget, error: BaseException) -> PlanOutcome:
        """Planning raised ``error``: a :class:`~lightning_memopt.planner.PlanError` says why itself.

        Example::

            >>> PlanOutcome.failed(PlanTarget(), ValueError("boom")).failure
            'planning failed: ValueError: boom'
        """
        failure = str(error) if isinstance(error, PlanError) else f"planning failed: {type(error).__name__}: {error}"
        return cls(target, None, failure, error)


def trainer_precision(trainer: Trainer) -> str | None:
    """The mixed precision the Trainer runs itself (``Trainer(precision=...)``), or ``None`` at ``"32-true"``."""
    precision = str(trainer.precision)
    return None if precision == "32-true" else precision


def hardware_for(device: torch.device, name: str | None, budget: float | None) -> Hardware:
    """The catalogue's ``name`` or the live ``device`` (off CUDA: this CPU, timed), with ``budget`` GiB if given
    (off CUDA, default the host memory available now). A catalogue GPU for a run off CUDA (a budget of a
    :class:`~lightning_memopt.memory.SimulatedDevice`) lends its rates; the run's tensors are counted as that
    device keeps them (no CUDA autocast lists, no cuBLAS or cuDNN workspaces).

    Example::

        >>> hardware_for(torch.device("cpu"), "a100_80gb", 10.0).memory_gib
        10.0
    """
    if name is not None:
        hardware = gpu(name)
        if device.type != "cuda":
            hardware = replace(hardware, device_type="cpu", workspace=None)
    elif device.type == "cuda":
        hardware = cuda_hardware(device)
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return measure_cpu(int(budget * GIB) if budget is not None else available)
    return hardware if budget is None else budget_of(hardware, budget)


def plan_for_target(
    module: LightningModule,
    batch: Any,
    hardware: Hardware,
    target: PlanTarget,
    verbose: bool = False,
    measured: bool = False,
    **options: Any,
) -> tuple[Plan | None, Knobs | None, str]:
    """Plan ``module`` on ``batch`` for ``target``: the plan (``None``: none could be made), its knobs (``None``:
    nothing fits) and why not. Logs the plan's report, every candidate if ``verbose`` (call it on rank 0); with
    ``measured`` (its candidates are to be measured) every kind is searched, and a plan that fits is left to be
    logged with its measured columns.

    Under ``fsdp_memopt`` the plan shards over every rank, with or without CPU offload; elsewhere it
    is unsharded, and when nothing fits so, the reason names the ``fsdp_memopt`` command whose plan
    fits, if one does. ``options`` go to :func:`~lightning_memopt.plan` (``safety_margin``, ``verify``, ``blocks``).

    Example::

        >>> from torch import nn
        >>> result, knobs, why = plan_for_target(
        ...     nn.Linear(8, 8), torch.randn(4, 8), gpu("a100_80gb"), PlanTarget(),
        ...     loss_fn=lambda m, x: m(x).sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        >>> knobs.describe(), why   # a step this small is launch-bound: autocast's casts would cost more than they save
        ('32-true', '')
    """
    precisions = None if target.precision is None else [target.precision]  # a Trainer's own precision is kept
    if target.fsdp:
        offload = (True,) if target.cpu_offload else (False, True)
        stored = target.precision is None  # a mixed precision from PrecisionSwitch: the units are gathered as stored
        layout = {"shards": [target.devices], "cpu_offload": offload, "gather_as_stored": stored}
        result = plan(
            module, batch, hardware, devices=target.devices, precisions=precisions, every_kind=measured, **layout,
            **options,
        )  # fmt: skip
    else:
        try:
            result = plan(
                module, batch, hardware, devices=target.devices, shards=[1], cpu_offload=(False,),
                precisions=precisions, every_kind=measured, **options,
            )  # fmt: skip
        except PlanError as error:  # the model states alone do not fit unsharded
            return None, None, _needs_fsdp(module, batch, hardware, target, str(error), options, verbose)
    if result.chosen is None or not measured:  # a measured plan is logged once measured, with its measured columns
        rank_zero_info(f"MemoryBudget:\n{result.table(verbose)}")
    if result.chosen is not None:
        return result, result.chosen.knobs, ""
    failure = _nothing_fits(result)
    return (
        result,
        None,
        failure if target.fsdp else _needs_fsdp(module, batch, hardware, target, failure, options, verbose),
    )


def _needs_fsdp(
    module: LightningModule,
    batch: Any,
    hardware: Hardware,
    target: PlanTarget,
    failure: str,
    options: dict[str, Any],
    verbose: bool = False,
) -> str:
    """Nothing fits unsharded: ``failure``, or the fsdp_memopt command when sharding over the ranks or CPU offload
    would fit."""
    try:
        result = plan(module, batch, hardware, devices=target.devices, **options)
    except PlanError:
        return failure
    if result.chosen is None:
        return failure
    rank_zero_info(f"MemoryBudget, sharded or offloaded:\n{result.table(verbose)}")
    knobs = result.chosen.knobs
    return (
        f"{failure}\nonly a plan with fsdp_memopt fits: {knobs.describe()} (peak "
        f"{result.chosen.peak_bytes / GIB:.2f} GiB); run it with {fsdp_command(knobs)}"
    )


def fsdp_command(knobs: Knobs) -> str:
    """The ``memopt-train`` command line that runs sharded or offloaded ``knobs``.

    Example::

        >>> fsdp_command(Knobs("bf16-mixed", cpu_offload=True)).split()[1:5]
        ['strategy=fsdp_memopt', 'trainer.devices=1', 'trainer.strategy.cpu_offload=true', 'precision=bf16_mixed']
    """
    return train_command([], knobs)


def _nothing_fits(result: Plan) -> str:
    smallest = min(result.candidates, key=lambda candidate: candidate.peak_bytes, default=None)
    closest = (
        f"; the smallest predicted peak is {smallest.peak_bytes / GIB:.2f} GiB ({smallest.knobs.describe()})"
        if smallest is not None
        else ""
    )
    return (
        f"no configuration that keeps the result fits within {result.limit_bytes / GIB:.2f} GiB{closest}; "
        "the candidates table is logged above (memopt-plan prints it too, with the options that change the result)"
    )
