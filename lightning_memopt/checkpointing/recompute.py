"""Full recomputation of a block no trace follows (:mod:`~lightning_memopt.checkpointing.traced_graph` refuses one
that draws random numbers, has hooks inside, ...): the block runs without autograd, and again in its backward.

``torch.utils.checkpoint`` (non-reentrant) builds the block's autograd graph in forward, calls a
Python hook for every tensor it would save, and in backward runs the block again under a second
pair of hooks that match each recomputed tensor to its handle. On a GPU that host work, not the
kernels, sets the step's time whenever the step is not large (measured on an H200: full
checkpointing of r50 at batch 32 cost 2.81× a step). :func:`recompute_in_backward` does what the
physics asks for: one forward without autograd, keeping only the block's inputs; in backward the
block's forward once more with autograd, and one ``torch.autograd.grad`` over it. Gradients reach
the block's parameters through the outer backward (their ``AccumulateGrad`` nodes, where DDP and
FSDP hook in), exactly once.

What the recomputation must see as the first run saw it:
- autocast: the state of the forward is restored;
- random numbers: a block that drew any in the forward (``Dropout``, stochastic depth) redraws the
  same in backward. Whether it draws is found on its first call in each training mode (the
  generators' states compared before and after); only then are the states saved and restored per call;
- batch-norm running statistics: updated once per step, by the first run; the recomputation runs with
  tracking paused (:meth:`~lightning_memopt.checkpointing.recompute_state.NormStatistics.paused`): the
  same output, and no kernel that updates statistics.

Example::

    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> from lightning_memopt.checkpointing.recompute_state import RecomputeState
    >>> recompute_in_backward(RecomputeState(block), block.forward, (x,)).sum().backward()
    >>> expected = torch.autograd.grad(block(x).sum(), x)[0]
    >>> torch.equal(x.grad, expected)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from lightning_memopt.checkpointing.recompute_state import RecomputeState, cuda_devices
from lightning_memopt.checkpointing.selective import KeepExpensive
from lightning_memopt.private_api import tree_flatten, tree_unflatten


def recompute_in_backward(
    state: RecomputeState,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    selective: bool = False,
) -> Any:
    """``forward(*args, **kwargs)`` run without autograd, recomputed in backward; its outputs as ``forward`` gives them.

    Gradients flow to the tensors among ``args`` and ``kwargs`` (any nesting) and to the
    parameters of ``state.module`` that require them. Outputs may nest tensors in tuples, lists and
    dicts. The backward cannot itself be differentiated (no double backward). ``selective``: the
    outputs of matmuls, convolutions and attention are kept from the first run and the
    recomputation runs only the other ops (:class:`~lightning_memopt.checkpointing.selective.KeepExpensive`); the
    first such calls time them, and the block's later calls recompute in full where keeping did not pay
    (:mod:`~lightning_memopt.checkpointing.selective_payoff`).

    Raises:
        RuntimeError: on a backward through it with ``create_graph=True`` (it would not be differentiable).
    """
    kwargs = kwargs or {}
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):  # the common call: no structure to keep
        leaves, spec, positions = list(args), None, list(range(len(args)))
    else:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    params = state.parameters()
    tensors = [leaves[i] for i in positions]
    for i in positions:  # the tensors go through save_for_backward only, which lets them go once backward used them
        leaves[i] = None
    call = _Call(state, forward, leaves, spec, positions, len(params), selective)
    outputs = _Recompute.apply(call, *tensors, *params)
    return call.rebuild(outputs)


class _Call:
    """One call's structure: how to rebuild the block's arguments from tensors, and its outputs from the Function's."""

    def __init__(
        self,
        state: RecomputeState,
        forward: Callable[..., Any],
        leaves: list[Any],
        spec: Any,
        positions: list[int],
        param_count: int,
        selective: bool,
    ) -> None:
        self.state, self.forward = state, forward
        self.leaves, self.spec, self.positions = leaves, spec, positions
        self.param_count = param_count
        self.kept: KeepExpensive | None = KeepExpensive(timed=state.selective.pays is None) if selective else None
        self.out_leaves: list[Any] = []
        self.out_spec: Any = None
        self.out_positions: list[int] = []
        self.rng: tuple[torch.Tensor, dict[torch.device, torch.Tensor]] | None = None
        self.autocast: list[tuple[str, bool, torch.dtype]] = []

    def run(self, tensors: tuple[torch.Tensor, ...], mode: Any = None) -> Any:
        """The block's forward on ``tensors``, under ``mode`` (a dispatch mode) if one is given."""
        if mode is not None:
            with mode:
                return self.run(tensors)
        if self.spec is None:
            return self.forward(*tensors)
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.forward(*args, **kwargs)

    def devices(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.device]:
        return cuda_devices(self.state.module, tensors)

    def keep_structure(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of ``output``; the rest of it kept to :meth:`rebuild` it."""
        if isinstance(output, torch.Tensor):
            self.out_spec = None
            return (output,)
        leaves, self.out_spec = tree_flatten(output)
        self.out_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tuple(leaves[i] for i in self.out_positions)

    def rebuild(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        if self.out_spec is None:
            return outputs[0]
        leaves = list(self.out_leaves)
        for position, tensor in zip(self.out_positions, outputs, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.out_spec)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tensors[: len(tensors) - call.param_count]
        ctx.call = call
        ctx.save_for_backward(*inputs)
        call.autocast = _autocast_state({t.device.type for t in inputs} | {"cpu"})
        training = call.state.module.training
        draws = call.state.draws.known(training)
        if draws is not False:  # it draws, or its first call in this mode may
            call.rng = (torch.get_rng_state(), _device_states(call.devices(inputs)))
        if draws is None:
            output = call.state.draws.observe(training, lambda: call.run(inputs, call.kept), call.devices(inputs))
            if not call.state.draws.known(training):
                call.rng = None
        else:
            output = call.run(inputs, call.kept)
        if call.kept is not None:
            intact = call.kept.intact()  # a kept output changed in place since is no longer the op's: recompute all
            if call.kept.timed:  # one of the block's first calls: does keeping pay on it?
                call.state.selective.decide(call.kept, type(call.state.module), used=intact)
            if not intact:
                call.kept = None
        # an input returned as it came is a new tensor to autograd (a view), as any other output
        outputs = tuple(
            out.view_as(out) if any(out is x for x in inputs) else out for out in call.keep_structure(output)
        )
        constant = [out for out in outputs if not (out.is_floating_point() or out.is_complex())]
        if constant:
            ctx.mark_non_differentiable(*constant)
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx.call.state.module).__name__} is checkpointed: its backward cannot be differentiated "
                "(create_graph=True); checkpoint it with torch.utils.checkpoint instead, or leave it unwrapped"
            )
        call: _Call = ctx.call
        ctx.call = None  # autograd keeps the node (and so ctx) to the end of backward: what it holds goes now
        needs = ctx.needs_input_grad[1:]
        inputs = ctx.saved_tensors
        detached = tuple(x.detach().requires_grad_(need) for x, need in zip(inputs, needs, strict=False))
        params = call.state.parameters()
        if len(params) != call.param_count:
            raise RuntimeError(
                f"{type(call.state.module).__name__} had {call.param_count} parameters requiring gradients in its "
                f"forward and {len(params)} in its recomputation"
            )
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for kind, enabled, dtype in call.autocast:
                if (enabled, dtype) != (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)):
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=False))
            if call.rng is not None:
                cpu_state, device_states = call.rng
                stack.enter_context(torch.random.fork_rng(devices=list(device_states), enabled=True))
                torch.set_rng_state(cpu_state)
                for device, device_state in device_states.items():
                    torch.cuda.set_rng_state(device_state, device)
            stack.enter_context(call.state.norm_stats.paused())
            replay = call.kept.replay() if call.kept is not None else None
            output = call.run(detached, replay)
        if replay is not None and replay.diverged is not None:
            call.state.selective.recompute_in_full(type(call.state.module), *replay.diverged)
        recomputed = (
            [output]
            if isinstance(output, torch.Tensor)
            else [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
        )
        roots = [
            (out, grad) for out, grad in zip(recomputed, grads, strict=True) if grad is not None and out.requires_grad
        ]
        targets = [x for x, need in zip(detached, needs, strict=False) if need]
        targets += [p for p, need in zip(params, needs[len(inputs) :], strict=True) if need]
        found: tuple[torch.Tensor | None, ...] = (None,) * len(targets)
        if roots and targets:
            outs, out_grads = zip(*roots, strict=True)
            found = torch.autograd.grad(outs, targets, out_grads, allow_unused=True)
        given = iter(found)
        return (None, *(next(given) if need else None for need in needs))


def reaches_one_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether :func:`recompute_in_backward` returns gradients bitwise equal to those of the uncheckpointed call.

    It hands back each input's gradient as one sum; autograd outside adds it to what the input gets from elsewhere.
    Where one input takes gradients from the block and from elsewhere in an order that interleaves, the sum is
    rounded otherwise (equal within rounding). A block of one tensor input requiring gradients (a residual block, an
    encoder layer) gets them in order; a block of several (a correlation of features also sampled elsewhere) is
    left to ``torch.utils.checkpoint``, which keeps the graph of the first run. So are tensors on devices other
    than the CPU and CUDA (their generators are not inspected here).

    Example::

        >>> x = torch.randn(2, requires_grad=True)
        >>> reaches_one_input((x, torch.ones(2)), {}), reaches_one_input((x,), {"skip": x * 2})
        (True, False)
    """
    needing = 0
    simple = not kwargs and all(isinstance(arg, torch.Tensor) for arg in args)
    for leaf in args if simple else tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type not in ("cpu", "cuda", "meta"):
                return False
            needing += leaf.requires_grad
    return needing <= 1


def _autocast_state(device_types: set[str]) -> list[tuple[str, bool, torch.dtype]]:
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in sorted(device_types)]


def _device_states(devices: list[torch.device]) -> dict[torch.device, torch.Tensor]:
    return {device: torch.cuda.get_rng_state(device) for device in devices if device.type == "cuda"}
