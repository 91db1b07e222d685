"""MemoryBudget: plan at fit start for the live model and device, and apply the plan through the other callbacks."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_memopt.arguments import check_int, check_optional_float
from lightning_memopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memopt.callbacks.adaptive_accumulation import AdaptiveAccumulation
from lightning_memopt.callbacks.precision_switch import PrecisionSwitch
from lightning_memopt.checkpointing import BlocksSpec, check_blocks
from lightning_memopt.models.structure import attention_kernels, set_attention
from lightning_memopt.planner import Hardware, Knobs, Plan, PlanError, cuda_hardware, measure_cpu, plan, with_budget
from lightning_memopt.planner import gpu as catalogue_gpu
from lightning_memopt.planner.hardware import GpuName
from lightning_memopt.planner.knobs import KnobsMapping
from lightning_memopt.planner.search import check_safety_margin
from lightning_memopt.strategies import MemoptFSDPStrategy
from lightning_memopt.vocabulary import GIB

_APPLIED_BY = (PrecisionSwitch, ActivationCheckpointing, AdaptiveAccumulation)


class MemoryBudget(Callback):
    """Pick the fastest configuration that fits the device at fit start, and apply it.

    In ``setup`` it profiles one step of the LightningModule on a batch of its training data in
    fake mode (nothing runs on the device), picks the knobs with :func:`~lightning_memopt.plan`
    and applies them: the precision through :class:`PrecisionSwitch`, activation checkpointing
    through :class:`ActivationCheckpointing` (on the model's declared, else discovered, blocks, or
    on ``blocks``), micro-batches through :class:`AdaptiveAccumulation`
    (added in every case: it stays on as the run-time safety net against an OOM), the attention
    kernel by switching the model's attention modules. Under DDP and FSDP rank 0 plans and every
    rank applies its plan. The knobs are saved in checkpoints; resuming with other knobs is refused
    (pass the saved ones as ``knobs``).
    ``plan`` holds the result; the table is logged at INFO on rank 0.

    Under ``fsdp_memopt`` (:class:`~lightning_memopt.strategies.MemoptFSDPStrategy`) it plans for
    the strategy's sharding over all ranks, with or without CPU offload (with it only, if the
    strategy was given ``cpu_offload=True``), and sets the strategy's ``cpu_offload`` before the
    strategy shards the model. A mixed precision applied by PrecisionSwitch has the units gathered
    as stored (fp32); a Trainer that runs the plan's precision itself (``precision="bf16-mixed"``,
    as the commands of ``memopt-plan`` set) gathers them in it, and is planned for that precision
    only. Under single-device and DDP strategies, when only a sharded or offloaded plan fits, it
    stops with the ``fsdp_memopt`` command to run instead.

    Args:
        budget: GiB to plan for; default the device's memory (off CUDA: the host memory available
            now; give a budget to plan for a :class:`~lightning_memopt.memory.SimulatedDevice`).
        gpu: a catalogue name (:data:`~lightning_memopt.planner.GPUS`, e.g. ``"a100_80gb"``) whose rates (and
            memory, unless ``budget``) to plan for; default the live device.
        safety_margin: the fraction of memory kept free, in [0, 1).
        knobs: apply these knobs (a mapping of :class:`~lightning_memopt.planner.Knobs` fields, as
            ``memopt-plan`` prints them: ``precision``, ``attn_impl``, ``checkpoint``, ``every_n``,
            ``micro_batch_size``, ``shards``, ``cpu_offload``) without planning.
        sample_batch: the batch to plan with, in the form the module's ``training_step`` takes; default
            the first batch of the datamodule's train loader.
        verify: the most candidates per group profiled to confirm an estimate.
        blocks: the modules checkpointing acts on: ``"auto"`` (declared, else discovered; ``"preset"``
            is the same), or module classes, dotted paths and name globs where discovery picks the wrong ones.

    Raises:
        MisconfigurationException: bad arguments (in ``__init__``); in ``setup``: a strategy other
            than single-device, DDP or ``fsdp_memopt``, a callback that would apply the knobs twice,
            knobs whose ``shards`` / ``cpu_offload`` the strategy cannot run (with the command that
            can), or no configuration that fits (with the candidates table).

    Example::

        >>> MemoryBudget(knobs={"precision": "bf16-mixed", "checkpoint": "full", "every_n": 2}).knobs.describe()
        'bf16-mixed, full every 2'
    """

    def __init__(
        self,
        budget: float | None = None,
        gpu: GpuName | None = None,
        safety_margin: float = 0.1,
        knobs: KnobsMapping | None = None,
        sample_batch: Any = None,
        verify: int = 3,
        blocks: BlocksSpec = "auto",
    ) -> None:
        try:
            check_blocks(blocks)  # whether they match the model is checked in setup
            self.knobs: Knobs | None = Knobs.from_mapping(knobs) if knobs is not None else None
            self.hardware_name = gpu
            if gpu is not None:
                catalogue_gpu(gpu)
            self.budget = check_optional_float("budget", budget, minimum=0, open_minimum=True)
            self.safety_margin = check_safety_margin(safety_margin)
            self.verify = check_int("verify", verify, minimum=0)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"MemoryBudget: {error}") from None
        self.sample_batch = sample_batch
        self.blocks = blocks
        self.plan: Plan | None = None
        self.applied: list[Callback] = []
        self._attention: dict[str, str] = {}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        for callback in self.applied:  # from an earlier fit of this Trainer
            if callback in _callbacks(trainer):
                _callbacks(trainer).remove(callback)
        if not isinstance(strategy, SingleDeviceStrategy | DDPStrategy | MemoptFSDPStrategy):
            raise MisconfigurationException(
                f"MemoryBudget plans for single-device, DDP and fsdp_memopt strategies, not {type(strategy).__name__}"
            )
        others = [type(c).__name__ for c in _callbacks(trainer) if isinstance(c, _APPLIED_BY) and c not in self.applied]
        if others:
            raise MisconfigurationException(
                f"MemoryBudget applies its plan through {', '.join(c.__name__ for c in _APPLIED_BY)}; remove the "
                f"Trainer's own {', '.join(others)} (or drop MemoryBudget)"
            )
        knobs = self.knobs or self._plan(trainer, pl_module)
        self.knobs = knobs
        self._apply(trainer, pl_module, knobs)

    def _plan(self, trainer: Trainer, pl_module: LightningModule) -> Knobs:
        knobs: dict[str, Any] | None = None
        failure, cause = "", None
        if trainer.is_global_zero:
            try:
                knobs, failure = self._plan_here(trainer, pl_module)
            except Exception as error:  # noqa: BLE001 (told to every rank, re-raised below as its cause)
                failure = (
                    str(error) if isinstance(error, PlanError) else f"planning failed: {type(error).__name__}: {error}"
                )
                cause = error
        # every rank learns the outcome, so none waits on a rank that failed
        knobs, failure = trainer.strategy.broadcast((knobs, failure))
        if knobs is None:
            raise MisconfigurationException(f"MemoryBudget: {failure}") from cause
        return Knobs(**knobs)

    def _plan_here(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict[str, Any] | None, str]:
        """Rank 0's plan for the Trainer's strategy: its knobs, or why there are none."""
        batch, hardware, world = self._batch(trainer), self._hardware(pl_module.device), trainer.world_size
        strategy, own = trainer.strategy, _trainer_precision(trainer)
        precisions = None if own is None else [own]  # a Trainer's own mixed precision is kept
        if isinstance(strategy, MemoptFSDPStrategy):
            offload = (True,) if strategy.cpu_offload else (False, True)
            stored = own is None  # a mixed precision from PrecisionSwitch: the units are gathered as stored
            options = {"shards": [world], "cpu_offload": offload, "gather_as_stored": stored}
            self.plan = self._run_plan(pl_module, batch, hardware, world, precisions=precisions, **options)
        else:
            try:
                self.plan = self._run_plan(
                    pl_module, batch, hardware, world, shards=[1], cpu_offload=(False,), precisions=precisions
                )
            except PlanError as error:  # the model states alone do not fit unsharded
                return None, self._needs_fsdp(pl_module, batch, hardware, world, str(error))
        rank_zero_info(f"MemoryBudget:\n{self.plan.table()}")
        chosen = self.plan.chosen
        if chosen is not None:
            return chosen.knobs.as_dict(), ""
        if isinstance(strategy, MemoptFSDPStrategy):
            return None, _nothing_fits(self.plan)
        return None, self._needs_fsdp(pl_module, batch, hardware, world, _nothing_fits(self.plan))

    def _run_plan(self, module: LightningModule, batch: Any, hardware: Hardware, devices: int, **options: Any) -> Plan:
        return plan(
            module,
            batch,
            hardware,
            safety_margin=self.safety_margin,
            verify=self.verify,
            blocks=self.blocks,
            devices=devices,
            **options,
        )

    def _needs_fsdp(self, module: LightningModule, batch: Any, hardware: Hardware, world: int, failure: str) -> str:
        """Nothing fits this strategy: ``failure``, or the fsdp_memopt command when sharding over the ranks or CPU
        offload would fit."""
        try:
            result = self._run_plan(module, batch, hardware, world)
        except PlanError:
            return failure
        if result.chosen is None:
            return failure
        rank_zero_info(f"MemoryBudget, sharded or offloaded:\n{result.table()}")
        knobs = result.chosen.knobs
        return (
            f"{failure}\nonly a plan with fsdp_memopt fits: {knobs.describe()} (peak "
            f"{result.chosen.peak_bytes / GIB:.2f} GiB); run it with {_fsdp_command(knobs)}"
        )

    def _hardware(self, device: torch.device) -> Hardware:
        if self.hardware_name is not None:
            hardware = catalogue_gpu(self.hardware_name)
        elif device.type == "cuda":
            hardware = cuda_hardware(device)
        else:  # off CUDA the memory is the host's: what is available now, unless a budget is given
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            return measure_cpu(int(self.budget * GIB) if self.budget is not None else available)
        return hardware if self.budget is None else with_budget(hardware, self.budget)

    def _batch(self, trainer: Trainer) -> Any:
        if self.sample_batch is not None:
            return self.sample_batch
        # the training loader from wherever fit() got it: a datamodule, the module, or fit's arguments
        loader = trainer.fit_loop._data_source.dataloader()
        return next(iter(loader))

    def _apply(self, trainer: Trainer, pl_module: LightningModule, knobs: Knobs) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, MemoptFSDPStrategy):
            if knobs.shards != trainer.world_size:
                raise MisconfigurationException(
                    f"MemoryBudget: `knobs` shards={knobs.shards} but fsdp_memopt shards over all "
                    f"{trainer.world_size} ranks; pass shards={trainer.world_size} (or run on {knobs.shards} devices)"
                )
            strategy.cpu_offload = knobs.cpu_offload  # the strategy shards in its own setup, after this hook
        elif knobs.sharding.active:
            raise MisconfigurationException(
                f"MemoryBudget: `knobs` {knobs.describe()!r} need the fsdp_memopt strategy, not "
                f"{type(strategy).__name__}: {_fsdp_command(knobs)}"
            )
        own = _trainer_precision(trainer)
        if own is not None and own != knobs.precision:
            raise MisconfigurationException(
                f"MemoryBudget: `knobs` precision={knobs.precision!r} but the Trainer runs {own!r}; leave the "
                "Trainer's precision at its default '32-true' (MemoryBudget applies the plan's) or give the same"
            )
        if knobs.attn_impl is not None:
            self._attention = attention_kernels(pl_module)
            set_attention(pl_module, knobs.attn_impl)
        self.applied = [AdaptiveAccumulation(micro_batch_size=knobs.micro_batch_size)]
        if knobs.precision != "32-true" and own is None:
            self.applied.append(PrecisionSwitch(knobs.precision))
        policy = knobs.checkpoint_policy(self.blocks)
        if policy is not None:
            self.applied.append(ActivationCheckpointing(policy))
        # Lightning visits callbacks appended during this hook in the same pass, so their setup runs next
        _callbacks(trainer).extend(self.applied)
        rank_zero_info(f"MemoryBudget: applying {knobs.describe()}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.knobs is None or not trainer.is_global_zero:
            return
        logged = {f"memopt/plan/{k}": v for k, v in self.knobs.as_dict().items()}
        if self.plan is not None:
            logged.update({f"memopt/plan/{k}": v for k, v in self.plan.summary().items()})
        for logger in trainer.loggers:
            logger.log_hyperparams(logged)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        set_attention(pl_module, self._attention)
        self._attention = {}
        # the applied callbacks come after this one in _callbacks(trainer): Lightning tears them down next

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs.as_dict() if self.knobs is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after setup has applied a plan: a resumed run must have the same one
        saved = state_dict.get("knobs")
        if saved is not None and self.knobs is not None and Knobs(**saved) != self.knobs:
            raise MisconfigurationException(
                f"MemoryBudget: the checkpoint was trained with {Knobs(**saved).describe()!r} but this run planned "
                f"{self.knobs.describe()!r}; resume with MemoryBudget(knobs={saved!r}) to continue the same run"
            )


def _fsdp_command(knobs: Knobs) -> str:
    """The ``memopt-train`` overrides that run sharded or offloaded ``knobs`` (Hydra is imported for it only)."""
    from lightning_memopt.planner.config import train_command

    return train_command([], knobs)


def _trainer_precision(trainer: Trainer) -> str | None:
    """The mixed precision the Trainer runs itself (``Trainer(precision=...)``), or ``None`` at ``"32-true"``."""
    precision = str(trainer.precision)
    return None if precision == "32-true" else precision


def _callbacks(trainer: Trainer) -> list[Callback]:
    return trainer.callbacks  # type: ignore[attr-defined]


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
