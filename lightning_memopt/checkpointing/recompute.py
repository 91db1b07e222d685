"""Full recomputation with the least host work: the block runs without autograd, and again in its backward.

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
- batch-norm running statistics: updated once per step, by the first run; the recomputation updates
  scratch copies (:class:`ScratchNormStats`), kept between steps.

Example::

    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> recompute_in_backward(RecomputeState(block), block.forward, (x,)).sum().backward()
    >>> expected = torch.autograd.grad(block(x).sum(), x)[0]
    >>> torch.equal(x.grad, expected)
    True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing.selective import KeepExpensive
from lightning_memopt.private_api import (
    assign_buffer,
    disable_current_modes,
    is_batch_norm,
    tree_flatten,
    tree_unflatten,
)


class ScratchNormStats:
    """The scratch running statistics a block's recomputation updates instead of the real ones, kept between calls.

    A batch norm in training normalises by the batch's statistics: the running ones it updates never
    change its output, so one scratch copy per buffer serves every recomputation of every step.

    Example::

        >>> norm = nn.BatchNorm1d(3)
        >>> scratch = ScratchNormStats(norm)
        >>> with scratch.swapped_in():
        ...     _ = norm(torch.randn(4, 3))
        >>> int(norm.num_batches_tracked), norm.running_mean.abs().sum().item()
        (0, 0.0)
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._norms: list[nn.Module] | None = None  # the block's batch norms, read at its first recomputation
        self._scratch: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:  # a pickled or copied model makes its scratch anew
        return {"module": self.module}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"])  # type: ignore[misc]

    def tracked(self) -> list[nn.Module]:
        """The block's batch norms that update running statistics now (in training, tracking them)."""
        if self._norms is None:
            self._norms = [m for m in self.module.modules() if is_batch_norm(m)]
        return [m for m in self._norms if m.training and m.track_running_stats]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The scratch statistics in place of the real ones, for the duration of a recomputation."""
        norms = self.tracked()
        real = [dict(norm.named_buffers(recurse=False)) for norm in norms]
        for norm, buffers in zip(norms, real, strict=True):
            _assign(norm, self._scratch_of(norm, buffers))
        try:
            yield
        finally:
            for norm, buffers in zip(norms, real, strict=True):
                _assign(norm, buffers)

    def _scratch_of(self, norm: nn.Module, real: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept = self._scratch.get(norm)
        if kept is None or any(_unlike(kept.get(name), buffer) for name, buffer in real.items()):
            with disable_current_modes():  # made once, outside any mode replaying the block's ops (selective)
                kept = {name: buffer.detach().clone() for name, buffer in real.items() if buffer is not None}
            self._scratch[norm] = kept
        return kept


class RandomDraws:
    """Whether a block draws random numbers, found on its first call in each training mode.

    The CPU generator's state and the devices' generator offsets are compared before and after
    the call: a block whose first call drew nothing is taken never to draw in that mode, and its
    recomputation needs no saved generator state.

    Example::

        >>> draws = RandomDraws()
        >>> draws.known(training=True) is None
        True
        >>> _ = draws.observe(True, lambda: torch.nn.functional.dropout(torch.ones(3), 0.5), [])
        >>> draws.known(training=True)
        True
    """

    def __init__(self) -> None:
        self._by_mode: dict[bool, bool] = {}

    def known(self, training: bool) -> bool | None:
        return self._by_mode.get(training)

    def observe(self, training: bool, run: Callable[[], Any], devices: list[torch.device]) -> Any:
        """Run ``run``, recording whether it advanced any generator (the CPU's, or those of ``devices``)."""
        before = _generator_states(devices)
        result = run()
        self._by_mode[training] = _generator_states(devices) != before
        return result


class RecomputeState:
    """What one checkpointed block keeps between its calls: its scratch statistics, whether it draws random
    numbers, and where its parameters live (read anew on every call: FSDP swaps the tensors in and out)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.norm_stats = ScratchNormStats(module)
        self.draws = RandomDraws()
        self._owners: list[tuple[nn.Module, str]] | None = None

    def parameters(self) -> list[torch.Tensor]:
        """The block's parameters that require gradients now."""
        if self._owners is None:
            modules = dict(self.module.named_modules())
            self._owners = [
                (modules[name.rpartition(".")[0]], name.rpartition(".")[2])
                for name, _ in self.module.named_parameters()
            ]
        found = (getattr(owner, name) for owner, name in self._owners)
        return [p for p in found if p is not None and p.requires_grad]


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
    recomputation runs only the other ops (:class:`~lightning_memopt.checkpointing.selective.KeepExpensive`).

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
        self.kept: KeepExpensive | None = KeepExpensive() if selective else None
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
        if call.kept is not None and not call.kept.intact():  # changed in place since: recompute them too
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
            stack.enter_context(call.state.norm_stats.swapped_in())
            output = call.run(detached, call.kept.replay() if call.kept is not None else None)
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


def cuda_devices(module: nn.Module, structure: Any) -> list[torch.device]:
    """The CUDA devices of ``module``'s parameters and of the tensors in ``structure`` (whose generators a call may
    advance)."""
    found = {leaf.device for leaf in tree_flatten(structure)[0] if isinstance(leaf, torch.Tensor)}
    found.update(p.device for p in module.parameters())
    return sorted((device for device in found if device.type == "cuda"), key=str)


def _autocast_state(device_types: set[str]) -> list[tuple[str, bool, torch.dtype]]:
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in sorted(device_types)]


def _generator_states(devices: list[torch.device]) -> tuple[Any, ...]:
    with disable_current_modes():  # read as the host's bytes, under fake mode or a tracker too
        cpu = bytes(torch.default_generator.get_state().numpy())
    return (cpu, *(_offset(device) for device in devices))


def _offset(device: torch.device) -> tuple[int, int]:
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return generator.initial_seed(), generator.get_offset()


def _device_states(devices: list[torch.device]) -> dict[torch.device, torch.Tensor]:
    return {device: torch.cuda.get_rng_state(device) for device in devices if device.type == "cuda"}


def _assign(norm: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, buffer in buffers.items():
        assign_buffer(norm, name, buffer)


def _unlike(kept: torch.Tensor | None, real: torch.Tensor | None) -> bool:
    if kept is None or real is None:
        return kept is not real
    return kept.shape != real.shape or kept.dtype != real.dtype or kept.device != real.device
