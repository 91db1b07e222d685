"""What a checkpointed block keeps between its calls: how its batch norms' statistics are left alone, whether it
draws random numbers, whether selective recomputation pays on it, and where its parameters live.

Example::

    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> state = RecomputeState(block)
    >>> len(state.parameters()), [type(m).__name__ for m in state.norm_stats.tracked()]
    (4, ['BatchNorm1d'])
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing.selective_payoff import SelectivePayoff, payoff_of
from lightning_memopt.private_api import assign_buffer, disable_current_modes, is_batch_norm, tree_flatten


class NormStatistics:
    """How a block's recomputation leaves its batch norms' running statistics alone: paused, or on scratch copies.

    A batch norm in training normalises by the batch's statistics: the running ones it updates never
    change its output. :meth:`paused` turns tracking off for the recomputation, so it launches no
    update kernels at all; the recomputation of :func:`~lightning_memopt.checkpointing.recompute.recompute_in_backward`
    builds a fresh graph and uses it. ``torch.utils.checkpoint`` instead checks that its recomputation saves
    what the first run saved (the running buffers among them), so under it :meth:`swapped_in` puts scratch
    copies in their place, one per buffer, kept between calls.

    Example::

        >>> norm = nn.BatchNorm1d(3)
        >>> statistics = NormStatistics(norm)
        >>> with statistics.paused():
        ...     _ = norm(torch.randn(4, 3))
        >>> int(norm.num_batches_tracked), norm.running_mean.abs().sum().item(), norm.track_running_stats
        (0, 0.0, True)
        >>> with statistics.swapped_in():
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
    def paused(self) -> Iterator[None]:
        """Tracking off for the duration of a recomputation: the norms normalise as before and update nothing."""
        norms = self.tracked()
        for norm in norms:
            norm.track_running_stats = False
        try:
            yield
        finally:
            for norm in norms:
                norm.track_running_stats = True

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
    """What one checkpointed block keeps between its calls: its norms' statistics, whether it draws random
    numbers, and where its parameters live (read anew on every call: FSDP swaps the tensors in and out)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.norm_stats = NormStatistics(module)
        self.draws = RandomDraws()
        self._owners: list[tuple[nn.Module, str]] | None = None

    @property
    def selective(self) -> SelectivePayoff:
        """Whether keeping the block's expensive ops pays, once its first selective calls are timed (the module's
        verdict: a copied model's blocks start afresh)."""
        return payoff_of(self.module)

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


def cuda_devices(module: nn.Module, structure: Any) -> list[torch.device]:
    """The CUDA devices of ``module``'s parameters and of the tensors in ``structure`` (whose generators a call may
    advance)."""
    found = {leaf.device for leaf in tree_flatten(structure)[0] if isinstance(leaf, torch.Tensor)}
    found.update(p.device for p in module.parameters())
    return sorted((device for device in found if device.type == "cuda"), key=str)


def _generator_states(devices: list[torch.device]) -> tuple[Any, ...]:
    with disable_current_modes():  # read as the host's bytes, under fake mode or a tracker too
        cpu = bytes(torch.default_generator.get_state().numpy())
    return (cpu, *(_offset(device) for device in devices))


def _offset(device: torch.device) -> tuple[int, int]:
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return generator.initial_seed(), generator.get_offset()


def _assign(norm: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, buffer in buffers.items():
        assign_buffer(norm, name, buffer)


def _unlike(kept: torch.Tensor | None, real: torch.Tensor | None) -> bool:
    if kept is None or real is None:
        return kept is not real
    return kept.shape != real.shape or kept.dtype != real.dtype or kept.device != real.device
