"""WorkCounter: the arithmetic, the bytes written, the kernels and the ops of a step, by phase and block.

Counted at dispatch level from shapes alone, so a step run under ``FakeTensorMode`` is counted as
exactly as a real one. Matmuls, convolutions and attention kernels get their floating-point
operations from PyTorch's flop formulas (plus the CPU flash-attention kernels those formulas
lack); every other op counts as memory traffic only. Ops count every aten call, views included: the
host's dispatch work, which a checkpointed block's Python work grows with. The planner turns these
counts into time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from lightning_memopt.memory.tracker import allocating_on_host
from lightning_memopt.private_api import CPU_FLASH_ATTENTION_OPS, TorchDispatchMode, same_memory, tree_flatten

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_CONVOLUTIONS = ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution")  # forward and backward
_NOT_KERNELS = frozenset({"detach", "alias", "lift_fresh", "_to_copy_noop"})
_COPY = torch.ops.aten.copy_.default


@dataclass
class Work:
    """What some ops did: floating-point operations (half / full precision), bytes written, kernels, ops."""

    half_flops: float = 0.0
    full_flops: float = 0.0
    bytes_written: float = 0.0
    kernels: float = 0.0
    matmul_bytes: float = 0.0  # the part of ``bytes_written`` that flop-counted ops (matmul, conv, attention) wrote
    matmul_kernels: float = 0.0
    conv_flops: float = 0.0  # the part of ``full_flops`` that fp32 convolutions did (cuDNN runs them in TF32)
    ops: float = 0.0  # aten calls, views and copies to the host included: what the host dispatched
    cast_kernels: float = 0.0  # the part of ``kernels`` that cast a float tensor to another float dtype (autocast's)
    cast_bytes: float = 0.0  # and the part of ``bytes_written`` they wrote

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)))

    def scaled(self, factor: float) -> Work:
        """Every count multiplied by ``factor``."""
        return Work(*(getattr(self, f.name) * factor for f in fields(Work)))

    def without_matmuls(self) -> Work:
        """The cheap part: what selective checkpointing recomputes (everything but matmuls and attention)."""
        return Work(bytes_written=self.bytes_written - self.matmul_bytes, kernels=self.kernels - self.matmul_kernels)

    @property
    def flops(self) -> float:
        return self.half_flops + self.full_flops


def _cpu_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """Q·Kᵀ and P·V of a (batch, heads, L, E) query against (batch, heads, S, E) keys and values."""
    batch_heads = query.shape[0] * query.shape[1]
    length, source = query.shape[-2], key.shape[-2]
    return 2 * batch_heads * length * source * (query.shape[-1] + value.shape[-1])


def _cpu_attention_backward_flops(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> int:
    # the scores are recomputed (one matmul), then dV, dP, dQ and dK: five matmuls against the forward's two
    return int(2.5 * _cpu_attention_flops(query, key, value))


def _formulas() -> dict[Any, Callable[..., int]]:
    formulas: dict[Any, Callable[..., int]] = dict(flop_registry)
    for packet, formula in flop_registry.items():  # ``baddbmm_``, ``addmm_``: the in-place variants do the same work
        in_place = getattr(torch.ops.aten, f"{packet.__name__}_", None)
        if in_place is not None:
            formulas.setdefault(in_place, formula)
    if CPU_FLASH_ATTENTION_OPS is not None:
        forward, backward = CPU_FLASH_ATTENTION_OPS
        formulas[forward] = _cpu_attention_flops
        formulas[backward] = _cpu_attention_backward_flops
    return formulas


class WorkCounter(TorchDispatchMode):
    """Count :class:`Work` per ``(phase, block)``, the phase and block read from ``context`` at each op.

    Args:
        context: an object with ``phase`` and ``current_block`` attributes (a
            :class:`~lightning_memopt.memory.MemoryTracker`); ``None`` counts everything under
            ``("", "")``.

    Example::

        >>> counter = WorkCounter()
        >>> with counter:
        ...     _ = (torch.ones(64, 32) @ torch.ones(32, 16)).t()
        >>> counter.total().full_flops, counter.total().kernels, counter.total().ops   # the transpose: an op only
        (65536.0, 3.0, 4.0)
    """

    def __init__(self, context: Any = None) -> None:
        super().__init__()
        self.context = context
        self.counts: dict[tuple[str, str], Work] = defaultdict(Work)
        self._formulas = _formulas()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        key = (getattr(self.context, "phase", ""), getattr(self.context, "current_block", ""))
        work = self.counts[key]
        work.ops += func.namespace == "aten"
        if not is_kernel(func, args):
            return out
        written = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        work.bytes_written += written
        work.kernels += 1
        if packet.__name__ == "_to_copy" and _casts(args[0], out):
            work.cast_kernels += 1
            work.cast_bytes += written
        formula = self._formulas.get(packet)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            first = next((t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
            if first is not None and first.dtype in _HALF_DTYPES:
                work.half_flops += flops
            else:
                work.full_flops += flops
                if packet.__name__.startswith(_CONVOLUTIONS):
                    work.conv_flops += flops
            work.matmul_bytes += written
            work.matmul_kernels += 1
        return out

    def total(self, phases: Iterable[str] | None = None, blocks: Iterable[str] | None = None) -> Work:
        """The work of the given phases and blocks (all of either when ``None``)."""
        return sum_work(self.counts, phases, blocks)


def is_kernel(func: Any, args: tuple[Any, ...] = ()) -> bool:
    """Whether an op on ``args`` runs a kernel of its own on the device (views, aliases, offload copies and a copy of a
    tensor onto itself do not: offload copies are priced by the bytes offloaded, over the host link; a traced
    graph hands back the buffers it updated in place, and copying them back returns at once)."""
    return (
        func.namespace == "aten"
        and not func.is_view
        and func.overloadpacket.__name__ not in _NOT_KERNELS
        and not (func is _COPY and same_memory(args[0], args[1]))
        and not allocating_on_host()
    )


def _casts(source: Any, out: Any) -> bool:
    """Whether a copy turned a floating-point tensor into another floating-point dtype."""
    return (
        isinstance(source, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and source.dtype != out.dtype
        and source.dtype.is_floating_point
        and out.dtype.is_floating_point
    )


class KernelCounter(TorchDispatchMode):
    """Count kernels and ops as :class:`WorkCounter` does, and nothing else (a tenth of its cost).

    Example::

        >>> with KernelCounter() as counter:
        ...     _ = (torch.ones(4, 4) @ torch.ones(4, 4)).t().relu()
        >>> counter.kernels, counter.ops    # the transpose is a view: an op, no kernel
        (4, 5)
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.kernels += is_kernel(func, args)
        self.ops += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


def sum_work(
    counts: dict[tuple[str, str], Work], phases: Iterable[str] | None = None, blocks: Iterable[str] | None = None
) -> Work:
    """Add up the ``(phase, block)`` counts of the given phases and blocks (all of either when ``None``)."""
    phase_set = None if phases is None else set(phases)
    block_set = None if blocks is None else set(blocks)
    result = Work()
    for (phase, block), work in counts.items():
        if (phase_set is None or phase in phase_set) and (block_set is None or block in block_set):
            result = result + work
    return result
