"""MemoptDDPStrategy: DDP with buckets as views, compression on any backend, PowerSGD state in checkpoints."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_optional_bool
from lightning_memopt.checkpointing import checkpoint_mode
from lightning_memopt.distributed import destroy_process_groups_at_exit
from lightning_memopt.strategies.comm_hooks import COMM_HOOKS, CommHookName, check_powersgd_options, comm_hook

POWERSGD_KEY = "memopt_powersgd"  # checkpoint entry: one PowerSGD state per rank


class MemoptDDPStrategy(DDPStrategy):
    """DDP configured for memory: gradient buckets as views, static graph under checkpointing, compressed all-reduce.

    The communication hook is registered on every device, CPU / gloo included (Lightning's own DDP
    registers hooks on CUDA only). PowerSGD's state (each rank's error feedback, the warm-start
    factors, the iteration) is saved in checkpoints under ``"memopt_powersgd"`` and restored on
    resume with the same world size. Each rank's error feedback is a copy of its gradients, so a
    checkpoint grows by world size × the model's fp32 size; rank 0 holds them in host memory while saving.

    Registered names: ``ddp_memopt``, ``ddp_powersgd``, ``ddp_fp16_compress``, ``ddp_bf16_compress``.

    Args:
        comm_hook: how gradients are all-reduced: ``"none"`` (DDP's C++ all-reduce), ``"allreduce"``
            (the same as a Python hook), ``"fp16"`` / ``"bf16"`` (half-precision all-reduce) or
            ``"powersgd"`` (rank-``powersgd_rank`` factors after ``powersgd_warmup`` iterations).
        powersgd_rank: the rank of PowerSGD's low-rank factors, at least 1.
        powersgd_warmup: iterations of plain all-reduce before PowerSGD starts, at least 2.
        error_feedback: PowerSGD adds each rank's compression error to its next gradients.
        static_graph: tell DDP each parameter's gradient arrives once per step; ``None`` (the
            default) turns it on at setup when activation checkpointing is active on the module.
        gradient_as_bucket_view: gradients live in DDP's communication buckets, saving one copy of
            the gradients.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``process_group_backend``, ``timeout``,
            ``start_method``, …) and ``DistributedDataParallel``'s (``find_unused_parameters``,
            ``broadcast_buffers``, …); not ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``
            or ``model_averaging_period``, which ``comm_hook`` replaces.

    Raises:
        MisconfigurationException: for an unknown ``comm_hook``, a bad PowerSGD option, or a flag
            (``error_feedback``, ``static_graph``, ``gradient_as_bucket_view``, ``find_unused_parameters``)
            that is neither a bool nor a word such as ``"on"`` / ``"off"``.

    Example::

        >>> strategy = MemoptDDPStrategy(comm_hook="powersgd", powersgd_rank=2, powersgd_warmup=100)
        >>> strategy.comm_hook_name, strategy._ddp_kwargs["gradient_as_bucket_view"]
        ('powersgd', True)
    """

    def __init__(
        self,
        comm_hook: CommHookName = "none",
        powersgd_rank: int = 1,
        powersgd_warmup: int = 1000,
        error_feedback: bool = True,
        static_graph: bool | None = None,
        gradient_as_bucket_view: bool = True,
        **kwargs: Any,
    ) -> None:
        try:
            if not isinstance(comm_hook, str) or comm_hook not in COMM_HOOKS:
                raise ValueError(f"Unknown `comm_hook`={comm_hook!r}; valid choices: {', '.join(COMM_HOOKS)}")
            powersgd_rank, powersgd_warmup, error_feedback = check_powersgd_options(
                powersgd_rank, powersgd_warmup, error_feedback
            )
            static_graph = check_optional_bool("static_graph", static_graph)
            gradient_as_bucket_view = check_bool("gradient_as_bucket_view", gradient_as_bucket_view)
            for name in ("find_unused_parameters", "broadcast_buffers"):  # DDP's own flags, from the config too
                if name in kwargs:
                    kwargs[name] = check_bool(name, kwargs[name])
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"MemoptDDPStrategy: {error}") from None
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(name) is not None:
                raise MisconfigurationException(
                    f"MemoptDDPStrategy registers its hook by name: give `comm_hook` (one of "
                    f"{', '.join(COMM_HOOKS)}), not `{name}`"
                )
        super().__init__(gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)
        self.comm_hook_name, self.static_graph = comm_hook, static_graph
        self._powersgd_options: dict[str, Any] = {
            "powersgd_rank": powersgd_rank,
            "powersgd_warmup": powersgd_warmup,
            "error_feedback": error_feedback,
        }
        self.comm_state: Any = None
        self.comm_hook: Any = None
        self._saved_powersgd: list[dict[str, Any]] | None = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_groups_at_exit()  # (Lightning does it for NCCL only)

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        static = self.static_graph
        if static is None:
            static = any(checkpoint_mode(module) is not None for module in model.modules())
            if static:
                rank_zero_info("MemoptDDPStrategy: activation checkpointing is active, so DDP runs with static_graph")
        self._ddp_kwargs["static_graph"] = static
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        """Register the named hook on any device (Lightning's DDP skips non-CUDA devices)."""
        assert isinstance(self.model, DistributedDataParallel)
        self.comm_state, self.comm_hook = comm_hook(self.comm_hook_name, self.model.module, **self._powersgd_options)
        if self.comm_hook is None:
            return
        if self.comm_hook_name == "powersgd" and self._saved_powersgd is not None:
            self._restore_powersgd()
        self.model.register_comm_hook(self.comm_state, self.comm_hook)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Add every rank's PowerSGD state (gathered on rank 0 over gloo, in host memory), then save as usual.

        Weights-only checkpoints (no optimizer state) leave it out.
        """
        if self.comm_hook_name == "powersgd" and self.comm_hook is not None and "optimizer_states" in checkpoint:
            states: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
            group = dist.new_group(backend="gloo", timeout=self._timeout)  # every rank saves at the same point
            try:
                dist.gather_object(self.comm_hook.state_dict(), states, dst=0, group=group)
            finally:
                dist.destroy_process_group(group)  # none left behind: a process may run many fits
            if self.is_global_zero:
                checkpoint = {**checkpoint, POWERSGD_KEY: states}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved_powersgd = checkpoint.get(POWERSGD_KEY)
        return checkpoint

    @override
    def teardown(self) -> None:
        self._saved_powersgd = None  # a state loaded by validate / test must not reach a later fit
        super().teardown()

    def _restore_powersgd(self) -> None:
        saved = self._saved_powersgd
        assert saved is not None
        self._saved_powersgd = None
        if len(saved) != self.world_size:
            rank_zero_warn(
                f"MemoptDDPStrategy: the checkpoint holds PowerSGD states of {len(saved)} ranks, this run has "
                f"{self.world_size}: PowerSGD starts afresh (its warm-up and error feedback from zero)"
            )
            return
        self.comm_hook.load_state_dict(saved[self.global_rank])
