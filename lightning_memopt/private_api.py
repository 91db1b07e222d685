"""Every private Lightning and torch API the project uses, in one place, each with the public API that is missing.

When a release of Lightning or torch moves one of these, this module is where it breaks and the
only one to mend: the rest of the package imports the names below. Each entry says what it reads
and which public API would replace it. Lightning is imported inside the functions that need it,
so that ``memory/`` (which runs without Lightning) can import this module.

Not here, because they are a subclass extending its base, not a use from outside:
``MemoptDDPStrategy`` overrides ``_setup_model`` and sets ``_ddp_kwargs``, ``MemoptFSDPStrategy``
overrides ``_get_process_group_backend`` and reads ``_process_group_backend``, and
``SwitchablePrecision`` calls its base's ``_after_closure``, as Lightning's own subclasses do;
``FaceVerification._sync_dist`` is the hook torchmetrics documents for custom state syncing.

Over 500 lines because it is the one place by design: each entry is a few lines with the public API it lacks, and
splitting them by topic would give a release's breakage several files to be found in.

Example::

    >>> import torch
    >>> from lightning_memopt.private_api import is_batch_norm, tree_flatten
    >>> is_batch_norm(torch.nn.BatchNorm2d(3)), len(tree_flatten({"a": torch.zeros(1), "b": [1, 2]})[0])
    (True, 3)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

# -- torch: fake tensors -------------------------------------------------------------------------------------
# missing: a public FakeTensorMode (torch.export and torch.compile use it internally); the planner profiles a
# step in it to predict a GPU's memory on the CPU
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

# -- torch: the active function modes ---------------------------------------------------------------------------
# missing: a public way to list the TorchFunctionModes active on this thread (autograd's engine runs a backward
# without them, so a recomputation in backward must enter again the ones its forward ran under)
from torch.overrides import _get_current_function_mode_stack as active_function_modes

# -- torch: dispatch modes and pytrees ---------------------------------------------------------------------
# missing: a public module for TorchDispatchMode (documented in the "extending PyTorch" notes, imported from
# torch.utils._python_dispatch there too) and a public pytree module (torch.utils.pytree is not in torch 2.13)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "BATCH_NORM_OPS",
    "CAST_OP",
    "active_function_modes",
    "CPU_FLASH_ATTENTION_OPS",
    "FakeTensorMode",
    "TorchDispatchMode",
    "abort_process_groups",
    "activation_memory_budget",
    "assign_buffer",
    "attach_trainer",
    "attached_trainer",
    "compile_decompositions",
    "compiled_checkpoint_side_effects",
    "compiled_frames",
    "composable_state_keys",
    "copy_tensors",
    "cuda_memory_snapshot",
    "disable_current_modes",
    "ends_optimizer_step",
    "fsdp_checkpoints_itself",
    "function_compiled",
    "graph_break_reasons",
    "has_hooks",
    "is_aten_op",
    "is_batch_norm",
    "is_fake",
    "is_traceable_wrapper_subclass",
    "lightning_console_handler",
    "logging_step",
    "min_cut_partition",
    "materialize_distributed_module",
    "module_compiled",
    "optimized_module_class",
    "optimizer_handles_unscaling",
    "optimizers_to_device",
    "powersgd_compresses",
    "point_logging_at",
    "recompile_limit",
    "record_cuda_memory_history",
    "reparametrized",
    "same_memory",
    "storage_base",
    "storage_key",
    "tensor_slots",
    "tensor_version",
    "trace_forward_and_backward",
    "training_dataloader",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "uncompile_module",
]

# -- torch: operators a dispatch mode recognises ----------------------------------------------------------------
# missing: public aliases; a dispatch mode sees these overloads by identity (a dtype cast of a parameter, and the
# CPU's fused attention, whose work the FLOP counter must know)
CAST_OP = torch.ops.aten._to_copy.default
_ATEN = torch.ops.aten
CPU_FLASH_ATTENTION_OPS = (  # (forward, backward), or None in a build without them
    (_ATEN._scaled_dot_product_flash_attention_for_cpu, _ATEN._scaled_dot_product_flash_attention_for_cpu_backward)
    if hasattr(_ATEN, "_scaled_dot_product_flash_attention_for_cpu")
    else None
)


# -- torch: tensors and modules ---------------------------------------------------------------------------------
def storage_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (itself when it is no view).

    missing: a public ``Tensor.base`` (``_base`` is what ``Tensor.is_view`` would need to name the viewed tensor).
    """
    return tensor._base if tensor._base is not None else tensor


def storage_key(tensor: torch.Tensor) -> int:
    """A key equal for tensors that share a storage (a view and its base), real or fake.

    missing: a public storage identity (``UntypedStorage._cdata``, what ``StorageWeakRef`` keys by).
    """
    return tensor.untyped_storage()._cdata


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor``'s data was modified in place (views share the count with their base).

    missing: a public version counter; autograd checks the same one (``Tensor._version``) before it uses a
    saved tensor, and offloading keys its host copies by it, so a tensor changed in place is copied anew.
    """
    return int(tensor._version)


def same_memory(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of one storage, in one layout and dtype (``copy_`` from one to the
    other returns at once, launching nothing).

    missing: ``Tensor.is_set_to`` answers this for real tensors but not for fake ones; ``torch._C._is_alias_of``
    (what ATen's ``copy_`` asks) does for both.
    """
    return (
        torch._C._is_alias_of(first, second)
        and first.storage_offset() == second.storage_offset()
        and first.shape == second.shape
        and first.stride() == second.stride()
        and first.dtype == second.dtype
    )


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself has forward or backward hooks (a trace of a module around it would skip them).

    missing: a public query of a module's hooks (``nn.Module`` keeps them in ``_forward_hooks`` and its kin).
    """
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, kind, None) for kind in kinds)


def composable_state_keys() -> frozenset[str]:
    """The attribute names under which ``torch.distributed``'s composable APIs (``fully_shard``, ``replicate``) keep
    a module's state in its ``__dict__``: bookkeeping of the hooks around the module, which its forward never reads.

    missing: a public way to tell that state from a module's own attributes (``contract.STATE_KEY`` and
    ``REGISTRY_KEY`` are random names made at import).
    """
    if not torch.distributed.is_available():
        return frozenset()
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    return frozenset((STATE_KEY, REGISTRY_KEY))


def tensor_slots(module: nn.Module) -> list[tuple[str, dict[str, Any], str]]:
    """Each parameter, then each buffer, of ``module`` (as ``named_parameters`` and ``named_buffers`` give them):
    its qualified name, the dict of the module that holds it, and its key there — to read the current tensors
    again cheaply on every call.

    missing: a public view of where a module's tensors live (``nn.Module._parameters`` / ``_buffers``).
    """
    owners = dict(module.named_modules())
    slots = []
    for kind, named in (("_parameters", module.named_parameters()), ("_buffers", module.named_buffers())):
        for name, _ in named:
            owner, _, key = name.rpartition(".")
            slots.append((name, getattr(owners[owner], kind), key))
    return slots


def is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` normalises by batch statistics: every BatchNorm, SyncBatchNorm and LazyBatchNorm.

    missing: a public base class; ``nn.modules.batchnorm._BatchNorm`` is the one they all share.
    """
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def assign_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the buffer ``name`` of ``module`` (it already has one of that name), as ``setattr`` would.

    missing: a cheap public setter; ``nn.Module.__setattr__`` goes through ``register_buffer``'s checks, ten times
    the cost of the dict entry it writes, and checkpointing swaps batch-norm statistics on every recomputation.
    """
    module._buffers[name] = tensor


def copy_tensors(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target in one fused call.

    missing: a public foreach API (``torch._foreach_*`` are what the optimizers' ``foreach`` paths call).
    """
    torch._foreach_copy_(targets, sources)


def abort_process_groups() -> None:
    """Abort this rank's process groups, so the other ranks' pending collectives fail now, not at their timeout.

    missing: a public abort; ``destroy_process_group()`` flushes pending NCCL collectives first, which waits
    for the ones the other ranks never join.
    """
    from torch.distributed.distributed_c10d import _abort_process_group

    if torch.distributed.is_initialized():
        _abort_process_group()


def powersgd_compresses(rows: int, columns: int, rank: int, min_compression_rate: float) -> bool:
    """Whether torch's PowerSGD hook compresses a ``rows`` × ``columns`` matrix at ``rank`` (else all-reduces it).

    missing: the hook's own test is private; the checkpointed PowerSGD state must place its P / Q buffers
    exactly as the hook does.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return bool(powerSGD_hook._should_compress(rows, columns, rank, min_compression_rate)[0])


def record_cuda_memory_history(enabled: bool, max_entries: int = 100_000, stacks: str = "all") -> None:
    """Start (or stop) the CUDA allocator's history, what an OOM snapshot shows; ``stacks="python"`` records no
    C++ frames.

    missing: a public name; ``torch.cuda.memory._record_memory_history`` is the API the PyTorch memory
    snapshot guide documents.
    """
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_snapshot(device: torch.device) -> Any:
    """The allocator's snapshot (with its history), for https://pytorch.org/memory_viz.

    missing: a public name; ``torch.cuda.memory._snapshot`` is the API the memory snapshot guide documents.
    """
    return torch.cuda.memory._snapshot(device)


# -- torch: what torch.compile left on a module ------------------------------------------------------------------
def optimized_module_class() -> type | None:
    """``torch.compile``'s module wrapper class, or ``None`` when nothing has been compiled in this process.

    missing: a public ``torch.compiler.is_compiled(module)``; ``OptimizedModule`` lives in ``torch._dynamo``,
    read from ``sys.modules`` because importing dynamo costs a second and nothing is compiled before it is.
    """
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def module_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place (the call implementation it swaps in).

    missing: a public flag for ``nn.Module.compile()``.
    """
    return getattr(module, "_compiled_call_impl", None) is not None


def uncompile_module(module: nn.Module) -> None:
    """Undo ``module.compile()``: the module's calls run its plain ``forward`` again.

    missing: a public inverse of ``nn.Module.compile()`` (it sets ``_compiled_call_impl``).
    """
    module._compiled_call_impl = None


def function_compiled(function: Callable[..., Any] | None) -> bool:
    """Whether ``function`` is a ``torch.compile``'d function (dynamo's wrapper keeps the original).

    missing: a public ``torch.compiler`` test for a compiled function.
    """
    return hasattr(function, "_torchdynamo_orig_callable")


# -- torch: what dynamo did with a checkpointed block ---------------------------------------------------------------
def compiled_checkpoint_side_effects(allowed: bool | None = None) -> bool:
    """Whether dynamo lets a checkpointed region's forward change Python state (set it when ``allowed`` is given).

    Returns the value before the call. Allowed, such a change (an attribute a forward sets, as transformers' Swin
    does) runs once, in the forward; refused (torch's default), the graph breaks at every checkpointed block.
    missing: a public switch (``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``).
    """
    import torch._dynamo

    before = bool(torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)
    if allowed is not None:
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = allowed
    return before


def graph_break_reasons() -> list[str]:
    """The reasons of the graph breaks dynamo met in this process so far, one string each.

    missing: a public record of graph breaks (``torch._dynamo.utils.counters["graph_break"]``; ``torch._dynamo.explain``
    runs the model again).
    """
    import torch._dynamo.utils

    return list(torch._dynamo.utils.counters["graph_break"])


def compiled_frames(function: Callable[..., Any]) -> int:
    """How many compiled entries dynamo holds for ``function``'s code (one per recompilation of it as a frame).

    missing: a public count (``torch._dynamo.eval_frame._debug_get_cache_entry_list``).
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(function.__code__))


def recompile_limit() -> int:
    """Dynamo's limit of compiled entries for one frame, past which it runs the frame eagerly.

    missing: a public name (``torch._dynamo.config.recompile_limit``; ``cache_size_limit`` before torch 2.7).
    """
    import torch._dynamo

    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


# -- torch: tracing a module's forward and backward into graphs ----------------------------------------------------
def trace_forward_and_backward(
    function: Callable[..., Any],
    partition: Callable[..., Any],
    parameters_and_buffers: int,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """``function`` traced (on its first call) into a forward and a backward graph of aten ops that ``partition``
    splits from the joint graph; both run as traced, compiled by nothing. The first ``parameters_and_buffers``
    arguments are a module's state; ``decompositions`` break ops into smaller ones as they are traced.

    missing: a public AOTAutograd entry (``functorch.compile.aot_function``, which ``torch.compile`` builds on, is
    documented as a prototype); imported here, on first use, as it loads part of ``torch._functorch``.
    """
    from functorch.compile import aot_function, make_boxed_func

    def as_traced(graph: Any, inputs: Any) -> Any:
        return make_boxed_func(graph.forward)

    return aot_function(
        function,
        as_traced,
        as_traced,
        partition_fn=partition,
        num_params_buffers=parameters_and_buffers,
        decompositions=decompositions,
    )


def activation_memory_budget(budget: float) -> Any:
    """A context in which the min-cut partitioner saves ``budget`` of what it could (0: recompute all it can).

    missing: a public setting (``torch._functorch.config.activation_memory_budget``; the documented
    ``torch.autograd.graph.region_activation_memory_budget`` only annotates code dynamo traces).
    """
    return torch._functorch.config.patch(activation_memory_budget=budget)


def compile_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions ``torch.compile``'s inductor applies before it partitions a joint graph.

    missing: a public table (``torch._inductor.decomposition.select_decomp_table``).
    """
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def contiguous_tangents() -> Any:
    """A context in which AOTAutograd traces a backward for gradients laid out contiguously (or channels-last, as the
    output suggests), not strided as the output: the plain step's gradients mostly are, and a gradient traced strided
    as a transposed output is copied to that layout on every call, then copied back to reshape it.

    missing: a public option (``torch._functorch.config.guess_tangent_strides_as_outputs``).
    """
    return torch._functorch.config.patch(guess_tangent_strides_as_outputs=False)


# the batch-norm ops of a traced graph: training mode returning the new running statistics (functional), by the
# batch's statistics alone, and updating the statistics in place; missing: public names (torch.export and
# torch.compile graphs hold the same underscored ops)
BATCH_NORM_OPS = SimpleNamespace(
    training=_ATEN._native_batch_norm_legit_functional.default,
    batch_statistics=_ATEN._native_batch_norm_legit.no_stats,
    in_place=_ATEN._native_batch_norm_legit.default,
)


@functools.cache
def decomposed_derivatives() -> tuple[Any, ...]:
    """The operator overloads that AOTAutograd's tracing, which runs under the Python dispatcher, differentiates
    through a Python decomposition instead of by their own derivative formulas (the upsampling ops, dropout, the
    recurrent layers, batch norm): the traced backward then computes what the plain step's does by other ops, in
    another order, unless traced under :func:`differentiated_by_formula`.

    missing: a public name for an operator's Python kernels (``OpOverload.py_kernels``) and for the registered
    operators (``torch._C._dispatch_get_all_op_names``).
    """
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, qualified = name.partition("::")
        packet_name, _, overload = qualified.partition(".")
        packet = getattr(getattr(torch.ops, namespace, None), packet_name, None) if namespace == "aten" else None
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None and any(key in op.py_kernels for key in _AUTOGRAD_KEYS):
            found.append(op)
    return tuple(found)


@contextlib.contextmanager
def differentiated_by_formula(ops: Iterable[Any]) -> Iterator[None]:
    """A context in which tracing differentiates the operator overloads ``ops`` by their own derivative formulas, as
    the plain step does: the Python autograd and composite kernels of their packets are set aside, in this process,
    and put back on leaving.

    missing: a public way to keep an operator whole in AOTAutograd's trace (``OpOverload.py_kernels`` and its
    dispatch cache).
    """
    keys = (*_AUTOGRAD_KEYS, torch._C.DispatchKey.CompositeImplicitAutograd)
    overloads = {getattr(op.overloadpacket, name) for op in ops for name in op.overloadpacket.overloads()}
    aside: list[tuple[Any, Any, Any]] = []
    try:
        for op in overloads:
            aside += [(op, key, op.py_kernels.pop(key)) for key in keys if key in op.py_kernels]
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, kernel in aside:
            op.py_kernels[key] = kernel
        for op in overloads:
            op._dispatch_cache.clear()


_AUTOGRAD_KEYS = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA)


@contextlib.contextmanager
def not_random(ops: Iterable[Any]) -> Iterator[None]:
    """A context in which the operator overloads ``ops`` are not tagged ``nondeterministic_seeded``: the min-cut
    partitioner recomputes them as plain ops (attention called with ``dropout_p=0`` draws nothing, yet is tagged).

    missing: a per-call way to tell the partitioner an op draws nothing (the tags of ``OpOverload``).
    """
    seeded = torch.Tag.nondeterministic_seeded
    untagged = [op for op in ops if seeded in op.tags]
    for op in untagged:
        op._tags = [tag for tag in op.tags if tag != seeded]
    try:
        yield
    finally:
        for op in untagged:
            op._tags = [*op.tags, seeded]


def is_aten_op(target: Any) -> bool:
    """Whether a graph node's ``target`` is an operator overload (``torch.ops.aten.mm.default``, say).

    missing: a public name for ``torch._ops.OpOverload``.
    """
    return isinstance(target, torch._ops.OpOverload)


def min_cut_partition(joint: Any, inputs: Any, **options: Any) -> tuple[Any, Any]:
    """AOTAutograd's partition of a joint graph that saves the least it can, and honours each node's
    ``meta["recompute"]`` (a ``torch.utils.checkpoint.CheckpointPolicy``) where one is set.

    missing: a public partitioner (``functorch.compile.min_cut_rematerialization_partition``).
    """
    from functorch.compile import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, inputs, **options)


def reparametrized(module: nn.Module, state: dict[str, torch.Tensor]) -> Any:
    """A context in which ``module``'s parameters and buffers are the tensors of ``state`` (by qualified name).

    missing: ``torch.func.functional_call`` does this around ``module(...)``; a checkpointed module's forward must be
    called beneath its instance ``forward`` (``torch.nn.utils.stateless._reparametrize_module``).
    """
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, state)


# -- Lightning ------------------------------------------------------------------------------------------------
def logging_step(trainer: Any) -> int:
    """The ``step`` Lightning gives the loggers for the training batch running now.

    It counts the optimizer steps finished before this batch's (it grows after ``on_train_batch_end``), so
    every micro-batch of one accumulated step shares it.
    missing: a public counter (``LearningRateMonitor`` reads it the same way); ``trainer.global_step`` is
    already one further in ``on_train_batch_end`` and counts every optimizer under manual optimization.
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def ends_optimizer_step(trainer: Any, pl_module: Any) -> bool:
    """Whether the training batch running now finishes an optimizer step (not a micro-batch that accumulates).

    It also decides when the loggers get a batch's values and when :func:`logging_step` grows; under manual
    optimization every batch is a step.
    missing: a public "last batch of the window" flag; ``fit_loop.epoch_loop._should_accumulate()`` is what
    Lightning's loop itself asks.
    """
    return not (pl_module.automatic_optimization and trainer.fit_loop.epoch_loop._should_accumulate())


def attached_trainer(module: nn.Module) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (also for a plain module).

    missing: a getter that does not raise; ``LightningModule.trainer`` raises outside a fit and hands out a
    new shim under Fabric.
    """
    return getattr(module, "_trainer", None)


def attach_trainer(module: nn.Module, trainer: Any) -> None:
    """Attach ``trainer`` (``None``: detach) to ``module`` alone.

    missing: a setter for one module; ``LightningModule.trainer``'s setter also sets every child LightningModule.
    """
    module._trainer = trainer


def training_dataloader(trainer: Any) -> Iterable[Any]:
    """The training loader from wherever ``fit()`` got it (a datamodule, the module, fit's arguments), in ``setup``.

    missing: ``Trainer.train_dataloader`` is set only after the ``setup`` hooks; ``fit_loop._data_source`` is
    where the loop will take it from.
    """
    return trainer.fit_loop._data_source.dataloader()


def point_logging_at(trainer: Any, batch: Any) -> None:
    """Make ``self.log`` weigh its ``on_epoch`` means by ``batch``'s size (a micro-batch of the step's batch).

    missing: a public way to run one step hook on several pieces of a batch; Lightning reads the batch size
    from ``trainer._results.batch``, which it sets once per step.
    """
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.batch, results.batch_size = batch, None


def lightning_console_handler() -> Any:
    """The console handler Lightning adds to its loggers on import (``None`` if it added none).

    missing: a public switch to route Lightning's log lines through the root logger instead.
    """
    import lightning

    return getattr(lightning, "_console", None)


def fsdp_checkpoints_itself(strategy: Any) -> bool:
    """Whether Lightning's ``FSDPStrategy`` was given an ``activation_checkpointing_policy`` of its own.

    missing: a public read of the policy the strategy was built with (it keeps only the derived kwargs).
    """
    return bool(getattr(strategy, "_activation_checkpointing_kwargs", None))


def optimizer_handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales fp16 gradients itself (fused optimizers), so the scaler must not.

    missing: a public test; Lightning's own AMP plugin asks ``lightning.fabric``'s private helper.
    """
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return bool(_optimizer_handles_unscaling(optimizer))


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Allocate and initialise the parameters of ``module`` built on the meta device, after sharding.

    missing: a public helper; Lightning's FSDP strategy calls the same one in its own ``setup``.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimizers' state to ``device`` (restored optimizer state is loaded on the CPU).

    missing: a public helper; Lightning's strategies call the same one.
    """
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)
