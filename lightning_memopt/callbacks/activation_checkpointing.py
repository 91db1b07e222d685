"""ActivationCheckpointing: checkpoint a LightningModule's blocks before the strategy wraps it."""

from __future__ import annotations

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_memopt.callbacks.model_setup import after_configure_model
from lightning_memopt.checkpointing import (
    CheckpointReport,
    PolicySpec,
    checkpoint_modules,
    parse_policy,
    remove_activation_checkpointing,
)
from lightning_memopt.models.structure import model_structure
from lightning_memopt.private_api import fsdp_checkpoints_itself


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
            of those (the first to match a module decides).

    Raises:
        MisconfigurationException: a malformed policy (in ``__init__``), or one that matches no
            module of the LightningModule (in ``setup``, listing the classes present).

    Example::

        >>> ActivationCheckpointing([{"modules": "backbone.blocks.*", "every_n": 2}, "offload"]).policies[1].mode
        'offload'
    """

    def __init__(self, policy: PolicySpec = "auto") -> None:
        try:
            self.policies = parse_policy(policy)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"ActivationCheckpointing: bad `policy`={policy!r}: {error}") from None
        self.report: CheckpointReport | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, FSDPStrategy) and fsdp_checkpoints_itself(strategy):
            rank_zero_info(
                "ActivationCheckpointing: the FSDP strategy has its own `activation_checkpointing_policy`; "
                "leaving checkpointing to it"
            )
            return
        after_configure_model(pl_module, lambda: self._apply(pl_module))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        remove_activation_checkpointing(pl_module)

    def _apply(self, pl_module: LightningModule) -> None:
        try:
            self.report = checkpoint_modules(pl_module, self.policies)
        except ValueError as error:
            raise MisconfigurationException(f"ActivationCheckpointing: {error}") from None
        found = ""
        if any(policy.modules is None for policy in self.policies):
            found = f"; blocks {model_structure(pl_module).source}"
        rank_zero_info(f"ActivationCheckpointing: {self.report.describe()}{found}")
