"""MemoptFSDPStrategy: FSDP2 (``fully_shard``) per model block, with no ``configure_model``; CPU offload at any size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_memopt.arguments import check_bool
from lightning_memopt.checkpointing.policy import BlocksSpec, check_blocks
from lightning_memopt.distributed import destroy_process_groups_at_exit
from lightning_memopt.private_api import materialize_distributed_module, optimizers_to_device
from lightning_memopt.strategies.sharding import ShardingError, shard_model

PARAM_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ParamDtype = Literal["auto", "bf16", "fp16", "fp32"]  # == tuple(PARAM_DTYPES)
_MIXED = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


def mixed_precision_policy(param_dtype: str, precision: str = "32-true") -> Any:
    """The FSDP2 ``MixedPrecisionPolicy``: units gathered and computed in ``param_dtype``, gradients reduced in fp32.

    ``"auto"`` follows the run's ``precision``: bf16 under ``bf16-mixed``, fp16 under ``16-mixed``,
    and no policy (``None``: parameters gathered as they are stored) otherwise, which is also what
    ``"fp32"`` gives.

    Raises:
        ValueError: for a ``param_dtype`` other than ``"auto"``, ``"bf16"``, ``"fp16"``, ``"fp32"``.

    Example::

        >>> policy = mixed_precision_policy("auto", "bf16-mixed")
        >>> policy.param_dtype, policy.reduce_dtype
        (torch.bfloat16, torch.float32)
        >>> mixed_precision_policy("auto", "32-true") is None
        True
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"Unknown `param_dtype`={param_dtype!r}; valid choices: {', '.join(PARAM_DTYPES)}")
    chosen = _MIXED.get(precision) if param_dtype == "auto" else param_dtype
    if chosen in (None, "fp32"):
        return None
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[chosen], reduce_dtype=torch.float32)


class MemoptFSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel on FSDP2: each rank keeps 1/N of parameters, gradients and optimizer state.

    The model is sharded when the strategy sets up, after ``configure_model`` (and after
    ActivationCheckpointing, whose checkpointed blocks are sharded as they are), with no code in
    the LightningModule: one ``fully_shard`` unit per block the model declares (else per
    repeated block discovered, or per module ``blocks`` selects), then one per direct child of
    the LightningModule holding the rest (:func:`~lightning_memopt.strategies.sharding.shard_units`).
    Only one unit's full parameters exist at a time, plus the next one prefetched. Every rank is
    a data-parallel rank: each gets its own share of the batches, as under DDP. Runs wherever
    ``torch.distributed`` does: CUDA with NCCL, the CPU with gloo.

    Checkpoints: with ``save_distributed_checkpoint`` (the default) a folder in which each rank
    writes its shard; :func:`~lightning_memopt.strategies.consolidate_checkpoint` (or
    ``memopt-export``) turns it into one file whose ``state_dict`` loads into the plain model.
    ``False`` gathers a full checkpoint on rank 0 instead. Either resumes exactly.

    Registered name: ``fsdp_memopt``.

    Args:
        cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory and
            run the optimizer step there (ZeRO-3-offload); the device holds only the units in flight
            and the activations. Works at ``devices=1`` too.
        reshard_after_forward: free each unit's gathered parameters after its forward and gather
            them again for its backward (ZeRO-3; the least memory). ``False`` keeps them from
            forward to backward (ZeRO-2 style: one gather fewer per step, a whole model's
            parameters in memory).
        param_dtype: the dtype units are gathered and computed in: ``"auto"`` (bf16 under
            ``precision="bf16-mixed"``, as stored otherwise), ``"bf16"``, ``"fp16"``, ``"fp32"``.
            Gradients are always reduced in fp32 and sharded parameters kept as stored. Under
            PrecisionSwitch ``"auto"`` gathers as stored, and the switchable autocast chooses the
            compute precision step by step.
        blocks: the units: ``"auto"`` (the blocks the model declares, else the repeated blocks
            discovered; ``"preset"`` is the same), or module classes, dotted class paths and name globs.
        save_distributed_checkpoint: one shard per rank (a folder), or a full checkpoint on rank 0.
        process_group_backend: the ``torch.distributed`` backend; ``None``: ``"gloo"`` on the CPU, and on
            CUDA ``"cuda:nccl,cpu:gloo"`` (NCCL for the units, gloo for shards offloaded to the host).
        timeout: how long a collective may wait for the other ranks (on the command line ``h:m:s``,
            e.g. ``0:30:00``); ``None`` is torch's default.

    Raises:
        MisconfigurationException: a bad argument (in ``__init__``: the flags take a bool or a word such
            as ``"on"`` / ``"off"``, anything else is refused); blocks matching nothing or parameters no
            unit can gather (in ``setup``).

    Example::

        >>> strategy = MemoptFSDPStrategy(cpu_offload=True)
        >>> strategy.cpu_offload, strategy.reshard_after_forward
        (True, True)
    """

    def __init__(
        self,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        param_dtype: ParamDtype = "auto",
        blocks: BlocksSpec = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        try:
            cpu_offload = check_bool("cpu_offload", cpu_offload)  # "off" is false, never truthiness
            reshard_after_forward = check_bool("reshard_after_forward", reshard_after_forward)
            save_distributed_checkpoint = check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
            if not isinstance(param_dtype, str) or param_dtype not in PARAM_DTYPES:
                raise ValueError(f"unknown `param_dtype`={param_dtype!r}; valid choices: {', '.join(PARAM_DTYPES)}")
            check_blocks(blocks)  # whether they match the model is checked in setup
            backend = process_group_backend
            if backend is not None and (not isinstance(backend, str) or not backend):
                raise TypeError(
                    f"`process_group_backend` must be a backend name ('gloo', 'nccl') or None, got {backend!r} "
                    f"({type(backend).__name__})"
                )
            if timeout is not None and not isinstance(timeout, timedelta):
                raise TypeError(
                    f"`timeout` must be a datetime.timedelta or None, got {timeout!r} ({type(timeout).__name__})"
                )
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"MemoptFSDPStrategy: {error}") from None
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.blocks = blocks
        self.units: list[str] = []  # the names of the modules sharded, once set up

    @override
    def setup_environment(self) -> None:
        # every rank a data-parallel rank (Lightning's default splits a node's devices for tensor parallelism)
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        destroy_process_groups_at_exit()  # (Lightning does it for NCCL only)

    @override
    def _get_process_group_backend(self) -> str:  # (Lightning's hook for the default backend; no public one)
        if self._process_group_backend is None and self.root_device.type == "cuda":
            # offloaded shards live on the host: norm clipping and overflow checks reduce them over gloo
            # (MemoryBudget may turn offload on after the group exists, so CUDA runs always get both)
            return "cuda:nccl,cpu:gloo"
        return super()._get_process_group_backend()

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)  # bf16-true: parameters stored in bf16
        self._shard()
        materialize_distributed_module(self.model, self.root_device)  # (a model built on the meta device)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

        module = self.lightning_module
        assert module is not None
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # sharded already: a second fit of the same module, or its own configure_model
        options: dict[str, Any] = {
            "mesh": self.device_mesh["data_parallel"],
            "reshard_after_forward": self.reshard_after_forward,
            # pinned host memory needs an accelerator
            "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if self.cpu_offload
            else OffloadPolicy(),
        }
        policy = mixed_precision_policy(self.param_dtype, _plain_precision(self.precision_plugin))
        if policy is not None:
            options["mp_policy"] = policy
        try:
            self.units = shard_model(module, self.blocks, **options)
        except ShardingError as error:
            raise MisconfigurationException(f"fsdp_memopt: {error}") from None
        gathered = policy.param_dtype if policy is not None else "as stored"
        offload = "; parameters, gradients and optimizer state on the host" if self.cpu_offload else ""
        rank_zero_info(
            f"fsdp_memopt: {len(self.units)} units over {self.world_size} ranks, gathered {gathered}{offload}"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explained():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explained():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explained():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explained():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _explained(self) -> Iterator[None]:
        """A parameter used while sharded (torch's "mixed torch.Tensor and DTensor"), with its cause and remedy."""
        try:
            yield
        except RuntimeError as error:
            if "mixed torch.Tensor and DTensor" not in str(error):
                raise
            raise RuntimeError(
                f"fsdp_memopt: a parameter was used while sharded ({error}). Its unit's forward was not called: the "
                "step calls a submodule of a unit directly, or a unit's method other than forward. The units are "
                f"{', '.join(self.units)}; pass `blocks=` (classes, dotted paths, globs) so that every module the "
                "step calls is a unit or inside one"
            ) from error

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.cpu_offload:
            self.model.to(self.root_device)
            return
        # FSDP moves the offloaded shards to the device when it gathers them; only buffers go now
        for submodule in self.model.modules():
            for name, buffer in submodule.named_buffers(recurse=False):
                setattr(submodule, name, buffer.to(self.root_device))


def _plain_precision(plugin: Any) -> str:
    """The precision a plugin runs, or ``"switchable"`` for PrecisionSwitch's (it changes during the run)."""
    from lightning_memopt.precision import SwitchablePrecision

    if isinstance(plugin, SwitchablePrecision):
        return "switchable"
    return str(getattr(plugin, "precision", "32-true"))
