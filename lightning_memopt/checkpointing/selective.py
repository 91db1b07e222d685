"""Selective recomputation: keep the outputs of expensive ops, recompute the cheap ones.

Matmuls, convolutions and attention kernels cost most to recompute and their outputs are what
the next op needs; element-wise and normalisation ops are cheap to redo but hold as many bytes.
Saving the first and recomputing the second keeps most of the memory saving of full
checkpointing for a fraction of its extra time (Korthikanti et al. 2022).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_memopt.private_api import TorchDispatchMode, is_fake, tensor_version, tree_flatten, tree_map

SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in SAVED_OP_NAMES if hasattr(torch.ops.aten, name))
# attention kernels that leave out the logsumexp their backward reads when autograd is off, as it is in a block's
# first run: op → the position of its ``compute_log_sumexp`` argument
_LOGSUMEXP_ARGUMENT = {
    op: position
    for op in SAVED_OPS
    for position, argument in enumerate(op._schema.arguments)
    if argument.name == "compute_log_sumexp"
}


def save_expensive_ops(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: save the outputs of :data:`SAVED_OPS`, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that applies :func:`save_expensive_ops`.

    Example::

        >>> from torch.utils.checkpoint import checkpoint
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> weight = torch.randn(8, 8, requires_grad=True)
        >>> out = checkpoint(lambda a: (a @ weight).relu(), x, use_reentrant=False, context_fn=selective_context)
        >>> out.sum().backward()
        >>> torch.equal(x.grad, ((x @ weight) > 0).float() @ weight.T)
        True
    """
    return create_selective_checkpoint_contexts(save_expensive_ops)


class KeepExpensive(TorchDispatchMode):
    """A dispatch mode that keeps the outputs of :data:`SAVED_OPS` as a block's first run makes them.

    :meth:`replay` gives the mode of its recomputation: those ops are not run again, their kept
    outputs are handed back in the same order, so autograd records the same graph over the same
    values (gradients bitwise equal) while only the cheap ops run. A kept output changed in place
    later in the first run is no longer what the op made: :meth:`intact` says so, and the caller
    recomputes everything instead. ``timed``: it also counts the ops it sees and times the kept ones
    (:meth:`kept_seconds`), for :class:`~lightning_memopt.checkpointing.selective_payoff.SelectivePayoff`.

    Example::

        >>> x, weight = torch.randn(4, 8), torch.randn(8, 8)
        >>> keep = KeepExpensive()
        >>> with keep:
        ...     first = (x @ weight).relu()
        >>> with keep.replay():
        ...     again = (x @ weight).relu()
        >>> len(keep.outputs), keep.intact(), torch.equal(first, again)
        (1, True, True)
    """

    def __init__(self, timed: bool = False) -> None:
        super().__init__()
        self.outputs: list[tuple[Any, Any, list[int]]] = []  # (op, output, the versions of its tensors)
        self.timed = timed
        self.ops = 0  # the ops it saw, while timed
        self._spans: list[Any] = []  # while timed, each kept op's seconds (CPU) or its pair of CUDA events
        self._untimed = False  # a kept op on fake or meta tensors, or on a device it does not time

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = _with_logsumexp(func, args, kwargs or {})
        if self.timed:
            self.ops += 1
        if func not in SAVED_OPS:
            return func(*args, **kwargs)
        output = self._timed_call(func, args, kwargs) if self.timed else func(*args, **kwargs)
        self.outputs.append((func, output, [tensor_version(t) for t in _tensors(output)]))
        return output

    def kept_seconds(self) -> float | None:
        """While timed: the time the kept ops took (waiting for a CUDA device to finish them); ``None`` where one
        could not be timed."""
        if self._untimed:
            return None
        seconds = 0.0
        for span in self._spans:
            if isinstance(span, float):
                seconds += span
            else:
                start, end = span
                end.synchronize()
                seconds += start.elapsed_time(end) / 1e3
        return seconds

    def _timed_call(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        device = "meta" if not tensors or any(map(is_fake, tensors)) else tensors[0].device.type
        if device == "cpu":
            started = time.perf_counter()
            output = func(*args, **kwargs)
            self._spans.append(time.perf_counter() - started)
            return output
        if device == "cuda" and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(tensors[0].device)  # the tensors' device, current or not
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            output = func(*args, **kwargs)
            end.record(stream)
            self._spans.append((start, end))
            return output
        self._untimed = True
        return func(*args, **kwargs)

    def intact(self) -> bool:
        """Whether every kept output still holds what its op made (none was changed in place since)."""
        return all([tensor_version(t) for t in _tensors(output)] == versions for _, output, versions in self.outputs)

    def replay(self) -> _Replay:
        """The mode for the recomputation: kept outputs in place of running their ops again."""
        return _Replay(self.outputs)


class _Replay(TorchDispatchMode):
    """Kept outputs in place of their ops, in order. Where the recomputation issues another kept op than the first
    run did (autograd on, an attention call may choose another kernel: transformers' Swin under CPU SDPA), the rest
    of the block runs for real: a full recomputation from there, and ``diverged`` says so."""

    def __init__(self, outputs: list[tuple[Any, Any, list[int]]]) -> None:
        super().__init__()
        self.outputs = iter(outputs)
        self.diverged: tuple[Any, Any] | None = None  # (the op the first run had, the op the recomputation ran)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in SAVED_OPS or self.diverged is not None:
            return func(*args, **(kwargs or {}))
        kept_func, output, _ = next(self.outputs, (None, None, None))
        if kept_func is not func:
            self.diverged = (kept_func, func)
            return func(*args, **(kwargs or {}))
        return tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) else value, output)


def _with_logsumexp(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``func``'s arguments asking for the logsumexp where it takes ``compute_log_sumexp``: the first run of a block
    has autograd off, and the replayed output must be what the op makes with it on (CUDA's memory-efficient and
    cuDNN attention return an empty logsumexp otherwise, which their backward refuses).

    Example::

        >>> q = torch.randn(1, 2, 40, 16, device="meta")
        >>> op = torch.ops.aten._scaled_dot_product_efficient_attention.default
        >>> args, kwargs = _with_logsumexp(op, (q, q, q, None, False), {})
        >>> op(*args, **kwargs)[1].shape  # padded to a multiple of 32 rows
        torch.Size([1, 2, 64])
    """
    position = _LOGSUMEXP_ARGUMENT.get(func)
    if position is None:
        return args, kwargs
    if position < len(args):
        return (*args[:position], True, *args[position + 1 :]), kwargs
    return args, {**kwargs, "compute_log_sumexp": True}


def _tensors(output: Any) -> list[torch.Tensor]:
    return [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
