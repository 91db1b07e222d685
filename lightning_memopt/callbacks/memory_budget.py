"""MemoryBudget: plan for the live model and device (at fit start, or ahead), apply it through callbacks it owns."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_float, check_int, check_optional_float
from lightning_memopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memopt.callbacks.adaptive_accumulation import AdaptiveAccumulation
from lightning_memopt.callbacks.compiled_step import CompiledStep
from lightning_memopt.callbacks.composite import CallbackGroup
from lightning_memopt.callbacks.memory_budget_plan import (
    PlanOutcome,
    PlanTarget,
    fsdp_command,
    hardware_for,
    plan_for_target,
    trainer_precision,
)
from lightning_memopt.callbacks.precision_switch import PrecisionSwitch
from lightning_memopt.checkpointing import BlocksSpec, check_blocks
from lightning_memopt.models.structure import attention_kernels, set_attention
from lightning_memopt.planner import Knobs, Plan
from lightning_memopt.planner import gpu as catalogue_gpu
from lightning_memopt.planner.compiled_plan import weigh_compiled
from lightning_memopt.planner.hardware import GpuName
from lightning_memopt.planner.knobs import KnobsMapping
from lightning_memopt.planner.measured import (
    NOT_TRIALLED,
    choose_by_measurement,
    choose_measured,
    run_trials,
    trials_of,
)
from lightning_memopt.planner.space import DEFAULT_SAFETY_MARGIN, check_safety_margin
from lightning_memopt.private_api import training_dataloader
from lightning_memopt.random_generators import random_state_kept
from lightning_memopt.strategies import MemoptFSDPStrategy

_APPLIED_BY = (PrecisionSwitch, ActivationCheckpointing, AdaptiveAccumulation, CompiledStep)


class MemoryBudget(CallbackGroup):
    """Pick the fastest configuration that fits the device at fit start, and apply it.

    In ``setup`` it profiles one step in fake mode, plans with :func:`~lightning_memopt.plan` and applies the knobs
    through callbacks it owns (``applied``); ``plan`` holds the result. Limitations: a resume with other knobs is
    refused; ``compile`` only on one device, ``measure`` not under FSDP (docs/guide/planning.md#memorybudget-in-detail).

    Args:
        budget: GiB to plan for; default the device's memory (off CUDA: the host memory available now).
        gpu: a catalogue name (:data:`~lightning_memopt.planner.GPUS`) to plan for; default the live device.
        safety_margin: the fraction of memory kept free, in [0, 1).
        knobs: apply these :class:`~lightning_memopt.planner.Knobs` fields, as ``memopt-plan`` prints them, unplanned.
        sample_batch: the batch to plan with; default the first batch of the datamodule's train loader.
        verify: the most candidates per group profiled to confirm an estimate.
        blocks: the modules checkpointing acts on: ``"auto"``, or module classes, dotted paths and name globs.
        verbose: log every candidate weighed, not only the short report (the Pareto front, at most 10 rows).
        measure: time the candidates on the device: ``"auto"`` (on an accelerator), ``True``, ``False``, ``"refresh"``.
        measure_candidates: the most candidates measured.
        measure_steps: the timed steps per candidate (after two that measure its peak); the fastest counts.
        measure_seconds: the most seconds spent measuring; a trial expected to end past them is not started.
        compile: weigh running the model ``torch.compile``d against the eager plan, both tried on the device.

    Example:
        >>> MemoryBudget(knobs={"precision": "bf16-mixed", "checkpoint": "full", "every_n": 2}).knobs.describe()
        'bf16-mixed, full every 2'
    """

    group_state_key = "applied"

    def __init__(
        self,
        budget: float | None = None,
        gpu: GpuName | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        knobs: KnobsMapping | None = None,
        sample_batch: Any = None,
        verify: int = 3,
        blocks: BlocksSpec = "auto",
        verbose: bool = False,
        measure: bool | str = "auto",
        measure_candidates: int = 6,
        measure_steps: int = 3,
        measure_seconds: float = 60.0,
        compile: bool = False,
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
            self.verbose = check_bool("verbose", verbose)
            self.measure = _check_measure(measure)
            self.measure_candidates = check_int("measure_candidates", measure_candidates, minimum=1)
            self.measure_steps = check_int("measure_steps", measure_steps, minimum=1)
            self.measure_seconds = check_float("measure_seconds", measure_seconds, minimum=0, open_minimum=True)
            self.compile = check_bool("compile", compile)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"MemoryBudget: {error}") from None
        super().__init__()
        self.sample_batch = sample_batch
        self.blocks = blocks
        self.plan: Plan | None = None
        self._ahead: PlanOutcome | None = None  # planned before the Trainer existed (rank 0)
        self._measured_later = False  # rank 0's plan is to be measured on every rank (DDP)
        self._attention: dict[str, str] = {}

    @property
    def applied(self) -> list[Callback]:
        """The callbacks applying the knobs (owned: their hooks run within this callback's)."""
        return self.callbacks

    def plan_ahead(
        self,
        pl_module: LightningModule,
        batch: Any = None,
        *,
        devices: int = 1,
        fsdp: bool = False,
        cpu_offload: bool = False,
        precision: str = "32-true",
        device: torch.device | str = "cpu",
    ) -> Knobs | None:
        """Plan now, for a Trainer still to be built as described; ``setup`` applies the plan.

        Planned on rank 0 only (a process started as another rank returns ``None``); in ``setup`` rank 0's
        knobs, or why nothing fits, go to every rank, as when planning there. A Trainer unlike the one
        described (world size, strategy, precision or device) is planned for again in ``setup``.

        Args:
            pl_module: the LightningModule to fit (profiled in fake mode, not changed).
            batch: a training batch, in the form ``training_step`` takes; default ``sample_batch``.
            devices: the Trainer's world size (devices × nodes).
            fsdp: the Trainer runs ``fsdp_memopt``.
            cpu_offload: ``fsdp_memopt`` was given ``cpu_offload=True`` (offloaded plans only).
            precision: the Trainer's own ``precision``.
            device: the device rank 0 trains on.

        Returns:
            The knobs; ``None`` when nothing fits (``setup`` raises why), or on another rank than 0.

        Raises:
            MisconfigurationException: no ``batch`` nor ``sample_batch``, or ``knobs`` were given (nothing to plan).

        Example::

            >>> from lightning_memopt.tasks import NormalEstimationModule
            >>> module = NormalEstimationModule(backbone="sapiens_tiny")
            >>> batch = {"image": torch.randn(2, 3, 64, 48), "normal": torch.randn(2, 3, 64, 48),
            ...          "mask": torch.ones(2, 1, 64, 48, dtype=torch.bool)}
            >>> MemoryBudget(budget=0.5, gpu="a100_80gb").plan_ahead(module, batch).describe()  # launch-bound: no casts
            '32-true, sdpa'
        """
        if self.knobs is not None:
            raise MisconfigurationException(f"MemoryBudget: `knobs` {self.knobs.describe()!r} were given: no plan")
        batch = self.sample_batch if batch is None else batch
        if batch is None:
            raise MisconfigurationException("MemoryBudget.plan_ahead: give a `batch` (or `sample_batch`) to plan with")
        if rank_zero_only.rank != 0:  # (set from RANK / LOCAL_RANK: the launcher's other processes)
            return None
        own = precision if precision != "32-true" else None
        target = PlanTarget(devices, fsdp, fsdp and cpu_offload, own, torch.device(device))
        self._ahead = self._outcome(pl_module, lambda: batch, target)
        return None if self._ahead.knobs is None else Knobs(**self._ahead.knobs)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._check_trainer(trainer)
            knobs = self.knobs or self._agreed_plan(trainer, pl_module)
            if self.compile and self.knobs is None:
                knobs = self._compiled_or_eager(trainer, pl_module, knobs)
            self.knobs = knobs
            self._apply(trainer, pl_module, knobs)
        super().setup(trainer, pl_module, stage)  # the applied callbacks' setup, in this hook

    def _check_trainer(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SingleDeviceStrategy | DDPStrategy | MemoptFSDPStrategy):
            raise MisconfigurationException(
                f"MemoryBudget plans for single-device, DDP and fsdp_memopt strategies, not {type(strategy).__name__}"
            )
        others = [type(c).__name__ for c in trainer.callbacks if isinstance(c, _APPLIED_BY)]  # type: ignore[attr-defined]
        if others:
            raise MisconfigurationException(
                f"MemoryBudget applies its plan through {', '.join(c.__name__ for c in _APPLIED_BY)}; remove the "
                f"Trainer's own {', '.join(others)} (or drop MemoryBudget)"
            )

    def _agreed_plan(self, trainer: Trainer, pl_module: LightningModule) -> Knobs:
        """Rank 0's knobs (planned ahead for this Trainer, or now) on every rank, or its reason on every rank."""
        knobs: dict[str, Any] | None = None
        failure, cause = "", None
        if trainer.is_global_zero:
            target, outcome = PlanTarget.of(trainer, pl_module), self._ahead
            if outcome is not None and outcome.target != target:
                rank_zero_info(
                    f"MemoryBudget: planned ahead for {outcome.target.describe()}, but the Trainer runs "
                    f"{target.describe()}: planning again"
                )
            if outcome is None or outcome.target != target:
                outcome = self._outcome(pl_module, lambda: self._batch(trainer), target)
            knobs, failure, cause = outcome.knobs, outcome.failure, outcome.cause
        self._ahead = None
        # every rank learns the outcome, so none waits on a rank that failed
        knobs, failure, measured = trainer.strategy.broadcast((knobs, failure, self._measured_later))
        if knobs is None:
            raise MisconfigurationException(f"MemoryBudget: {failure}") from cause
        if measured:
            return self._measured_on_every_rank(trainer, pl_module)
        return Knobs(**knobs)

    def _measured_on_every_rank(self, trainer: Trainer, pl_module: LightningModule) -> Knobs:
        """Rank 0's trials run on every rank (each on its own device and first batch), their outcomes agreed on
        (an OOM on any rank is one on all, the time the slowest rank's), and rank 0's choice broadcast."""
        strategy, first = trainer.strategy, trainer.is_global_zero
        device = strategy.root_device

        def agree(values: list[float]) -> list[float]:
            return strategy.reduce(torch.tensor(values, dtype=torch.float64, device=device), reduce_op="max").tolist()

        with random_state_kept():
            batch = self._batch(trainer)
            started = time.perf_counter()
            options = {"most": self.measure_candidates, "refresh": self.measure == "refresh"}
            trials = (
                trials_of(self.plan, pl_module, batch, device, devices=trainer.world_size, **options) if first else None
            )
            trials = strategy.broadcast(trials)
            if not trials.candidates:
                self._log_measured(NOT_TRIALLED)
            else:
                measurements = run_trials(
                    trials, pl_module, batch, device, blocks=self.blocks, steps=self.measure_steps,
                    seconds=self.measure_seconds, agree=agree,
                )  # fmt: skip
                if first:
                    report = choose_measured(self.plan, trials, measurements, time.perf_counter() - started)
                    self._log_measured(f"on every rank, {report}")
        return Knobs(**strategy.broadcast(self.plan.chosen.knobs.as_dict() if first else None))

    def _outcome(self, pl_module: LightningModule, batch: Any, target: PlanTarget) -> PlanOutcome:
        """Plan for ``target`` on ``batch()``: a failure of any kind is the outcome's (told to every rank in setup)."""
        try:
            # what planning draws (a loader's iterator its seed, timing this CPU its inputs) leaves the run's alone
            with random_state_kept():
                hardware = hardware_for(target.device, self.hardware_name, self.budget)
                measuring = self._measures(target)
                options = {"safety_margin": self.safety_margin, "verify": self.verify, "blocks": self.blocks}
                sample = batch()
                self.plan, knobs, failure = plan_for_target(
                    pl_module, sample, hardware, target, verbose=self.verbose, measured=measuring, **options
                )
                self._measured_later = knobs is not None and measuring and target.devices > 1  # on every rank
                if knobs is not None and measuring and target.devices == 1:
                    knobs = self._measured_choice(pl_module, sample, target)
        except Exception as error:  # noqa: BLE001 (told to every rank, re-raised there as the cause)
            return PlanOutcome.failed(target, error)
        return PlanOutcome(target, None if knobs is None else knobs.as_dict(), failure)

    def _measures(self, target: PlanTarget) -> bool:
        wanted = target.device.type != "cpu" if self.measure == "auto" else bool(self.measure)
        if wanted and target.fsdp:
            rank_zero_info(f"MemoryBudget: not measured on {target.describe()} (a trial cannot shard): priced")
            return False
        return wanted

    def _measured_choice(self, pl_module: LightningModule, batch: Any, target: PlanTarget) -> Knobs:
        """On one device: the candidates predicted to fit, timed there; the fastest measured that fits, else the
        one of the least predicted peak (under AdaptiveAccumulation, as every plan runs)."""
        report = choose_by_measurement(
            self.plan, pl_module, batch, target.device, blocks=self.blocks, most=self.measure_candidates,
            steps=self.measure_steps, seconds=self.measure_seconds, refresh=self.measure == "refresh",
        )  # fmt: skip
        self._log_measured(report)
        return self.plan.chosen.knobs

    def _compiled_or_eager(self, trainer: Trainer, pl_module: LightningModule, knobs: Knobs) -> Knobs:
        """The plan's knobs, or the same compiled, whichever ends the run sooner (tried on one device)."""
        if trainer.world_size > 1 or self.plan is None:
            rank_zero_info("MemoryBudget: compile is weighed on one device (and after a plan): the eager plan applies")
            return knobs
        try:
            with random_state_kept():
                verdict = weigh_compiled(
                    self.plan, pl_module, self._batch(trainer), trainer.strategy.root_device,
                    steps_left=max(1, int(trainer.estimated_stepping_batches)), blocks=self.blocks,
                    trial_steps=self.measure_steps,
                )  # fmt: skip
        except Exception as error:  # noqa: BLE001 (compiling is an option: the eager plan stands)
            rank_zero_warn(
                f"MemoryBudget: compile not weighed ({type(error).__name__}: {error}); the eager plan applies"
            )
            return knobs
        rank_zero_info(f"MemoryBudget: {verdict.report}")
        return verdict.knobs

    def _log_measured(self, report: str) -> None:
        rank_zero_info(f"MemoryBudget:\n{self.plan.table(self.verbose)}\n{report}")

    def _batch(self, trainer: Trainer) -> Any:
        if self.sample_batch is not None:
            return self.sample_batch
        return next(iter(training_dataloader(trainer)))

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
                f"{type(strategy).__name__}: {fsdp_command(knobs)}"
            )
        own = trainer_precision(trainer)
        if own is not None and own != knobs.precision:
            raise MisconfigurationException(
                f"MemoryBudget: `knobs` precision={knobs.precision!r} but the Trainer runs {own!r}; leave the "
                "Trainer's precision at its default '32-true' (MemoryBudget applies the plan's) or give the same"
            )
        if knobs.attn_impl is not None:
            self._attention = attention_kernels(pl_module)
            set_attention(pl_module, knobs.attn_impl)
        applied: list[Callback] = [AdaptiveAccumulation(micro_batch_size=knobs.micro_batch_size)]
        if knobs.precision != "32-true" and own is None:
            applied.append(PrecisionSwitch(knobs.precision))
        policy = knobs.checkpoint_policy(self.blocks)
        if policy is not None:
            applied.append(ActivationCheckpointing(policy))
        if knobs.compile_budget is not None:
            applied.append(CompiledStep(knobs.compile_budget))
        self.callbacks = applied  # their setup runs next, in this hook
        rank_zero_info(f"MemoryBudget: applying {knobs.describe()}")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.knobs is not None and trainer.is_global_zero:
            logged = {f"memopt/plan/{k}": v for k, v in self.knobs.as_dict().items()}
            if self.plan is not None:
                logged.update({f"memopt/plan/{k}": v for k, v in self.plan.summary().items()})
                if self.plan.measure_seconds is not None:
                    logged["memopt/plan_measure_seconds"] = round(self.plan.measure_seconds, 3)
            for logger in trainer.loggers:
                logger.log_hyperparams(logged)
        super().on_train_start(trainer, pl_module)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            set_attention(pl_module, self._attention)
            self._attention = {}
        super().teardown(trainer, pl_module, stage)  # then the applied callbacks'

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs.as_dict() if self.knobs is not None else None, **super().state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after setup has applied a plan: a resumed run must have the same one
        saved = state_dict.get("knobs")
        if saved is not None and self.knobs is not None and Knobs(**saved) != self.knobs:
            raise MisconfigurationException(
                f"MemoryBudget: the checkpoint was trained with {Knobs(**saved).describe()!r} but this run planned "
                f"{self.knobs.describe()!r}; resume with MemoryBudget(knobs={saved!r}) to continue the same run"
            )
        super().load_state_dict(state_dict)  # the applied callbacks' states (older checkpoints: on_load_checkpoint)


def _check_measure(value: Any) -> bool | str:
    if value in ("auto", "refresh"):
        return value
    try:
        return check_bool("measure", value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`measure`={value!r} is not one of the valid choices: 'auto', 'refresh', True, False"
        ) from None
