"""ActivationCheckpointing: checkpoint a LightningModule's blocks before the strategy wraps it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.callbacks.memory_budget_plan import hardware_for
from lightning_memopt.callbacks.module_hooks import after_configure_model
from lightning_memopt.checkpointing import (
    ActivationBudget,
    CheckpointReport,
    PolicySpec,
    checkpoint_modules,
    parse_policy,
    remove_activation_checkpointing,
)
from lightning_memopt.checkpointing.under_compile import CompiledCheckpointWatch
from lightning_memopt.checkpointing.wrap import CheckpointedForward
from lightning_memopt.models.structure import model_structure
from lightning_memopt.planner.checkpoint_budget import plan_checkpointing
from lightning_memopt.private_api import fsdp_checkpoints_itself, training_dataloader
from lightning_memopt.vocabulary import PROFILE_PRECISIONS

WATCHED_BATCHES = 3  # the training batches after which a compiled model's graph breaks are looked for (recompiles
# come with the second)


class ActivationCheckpointing(Callback):
    """Inject non-reentrant activation checkpointing into the model, with no change to its code.

    The policy is applied in ``setup``, or right after ``configure_model`` when the module builds
    its layers there, so always before the strategy wraps the model; it is removed again in
    ``teardown``, leaving the module as it was. Checkpointing patches ``forward`` of the chosen
    modules instead of replacing them, so ``state_dict`` keys are unchanged and DDP works (no
    "marked ready twice": nothing is reentrant). Under FSDP with its own
    ``activation_checkpointing_policy`` the strategy's policy is used and this callback stands
    aside, so nothing is checkpointed twice.

    Args:
        policy: what to checkpoint and how; see
            :func:`~lightning_memopt.checkpointing.apply_activation_checkpointing`. ``"auto"``
            (the default; ``"preset"`` is the same) checkpoints the blocks the model declares,
            and the repeated blocks discovered where it declares none, so it works on any model;
            ``"selective"``, ``"offload"`` and ``"every_n"`` act on the same blocks in those ways. Or a
            module class, dotted class path or name glob, a mapping ``{modules, every_n, mode}``, or a list
            of those (the first to match a module decides). ``{"budget": b}``: see below.
        sample_batch: the batch a ``{"budget": b}`` policy plans with, in the form the module's
            ``training_step`` takes; default: the first training batch. Unused by the other policies.

    Raises:
        MisconfigurationException: a malformed policy (in ``__init__``), or one that matches no
            module of the LightningModule (in ``setup``, listing the classes present).

    ``{"budget": b}`` (``b`` a fraction in (0, 1] of the activation peak without checkpointing, or
    bytes) chooses each block's mode itself: in ``setup`` of a fit, rank 0 profiles one step on
    ``sample_batch`` in fake mode, prices every block's
    options for the run's device and precision, and picks the fastest set within the budget (the
    checkpointing knapsack, :func:`~lightning_memopt.planner.plan_checkpointing`); every
    rank applies rank 0's choice. Out of reach, the least activation peak is applied, with a warning.
    Outside a fit nothing is checkpointed (no backward pass).

    Under ``torch.compile`` the checkpointed blocks trace into the compiled graph; if dynamo breaks its graph at
    them instead (each block then compiles as a frame of its own), the first training batches say so once, naming
    the blocks, dynamo's reason and the fix.

    Example::

        >>> ActivationCheckpointing([{"modules": "backbone.blocks.*", "every_n": 2}, "offload"]).policies[1].mode
        'offload'
        >>> ActivationCheckpointing({"budget": 0.4}).policies[0].describe()
        'budget(0.4 of the activation peak, auto)'
    """

    def __init__(self, policy: PolicySpec = "auto", sample_batch: Any = None) -> None:
        try:
            self.policies = parse_policy(policy)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"ActivationCheckpointing: bad `policy`={policy!r}: {error}") from None
        self.sample_batch = sample_batch
        self.report: CheckpointReport | None = None
        self.chosen: dict[str, str] | None = None  # a budget's choice: block name -> mode
        self.compile_watch = CompiledCheckpointWatch(CheckpointedForward.__call__)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, FSDPStrategy) and fsdp_checkpoints_itself(strategy):
            rank_zero_info(
                "ActivationCheckpointing: the FSDP strategy has its own `activation_checkpointing_policy`; "
                "leaving checkpointing to it"
            )
            return
        if isinstance(self.policies[0], ActivationBudget) and stage != "fit":
            return  # without a backward pass nothing is saved for it
        after_configure_model(pl_module, lambda: self._apply(trainer, pl_module))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.compile_watch.start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.report is None or batch_idx >= WATCHED_BATCHES:
            return
        trouble = self.compile_watch.trouble(sum(self.report.classes.values(), Counter()))
        if trouble:
            rank_zero_warn(f"ActivationCheckpointing: {trouble}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        remove_activation_checkpointing(pl_module)

    def _apply(self, trainer: Trainer, pl_module: LightningModule) -> None:
        policies: Any = self.policies
        if isinstance(self.policies[0], ActivationBudget):
            self.chosen = trainer.strategy.broadcast(self._choose(trainer, pl_module, self.policies[0]))
            if not self.chosen:
                rank_zero_info("ActivationCheckpointing: the activations fit the budget; nothing checkpointed")
                return
            policies = [{"modules": name, "mode": mode} for name, mode in self.chosen.items()]
        try:
            self.report = checkpoint_modules(pl_module, policies)
        except ValueError as error:
            raise MisconfigurationException(f"ActivationCheckpointing: {error}") from None
        found = ""
        if any(policy.modules is None for policy in self.policies):
            found = f"; blocks {model_structure(pl_module).source}"
        rank_zero_info(f"ActivationCheckpointing: {self.report.describe()}{found}")

    def _choose(self, trainer: Trainer, pl_module: LightningModule, rule: ActivationBudget) -> dict[str, str] | None:
        """Rank 0's fastest per-block choice within ``rule``'s budget (``None`` on the other ranks)."""
        if not trainer.is_global_zero:
            return None
        precision = str(trainer.precision)
        if precision not in PROFILE_PRECISIONS:
            raise MisconfigurationException(
                f"ActivationCheckpointing: a budget is planned by profiling the step, which runs at "
                f"{', '.join(PROFILE_PRECISIONS)}, not the Trainer's precision={precision!r}; name the blocks and "
                "modes instead"
            )
        batch = self.sample_batch if self.sample_batch is not None else next(iter(training_dataloader(trainer)))
        hardware = hardware_for(trainer.strategy.root_device, None, None)
        blocks = "auto" if rule.modules is None else rule.modules
        choice = plan_checkpointing(
            pl_module, batch, rule.budget, precision=precision, hardware=hardware, blocks=blocks
        )
        message = f"ActivationCheckpointing: {rule.describe()}: {choice.describe()}"
        if choice.fits:
            rank_zero_info(message)
        else:
            rank_zero_warn(f"{message}; the budget is out of reach: the least activation peak is applied")
        return choice.modes
