"""PowerSGD with a resumable state: error feedback and warm-start factors kept per parameter, not per DDP bucket.

torch's PowerSGD keys its state by bucket and stores each bucket as one flat buffer. A DDP model
built anew (as on resume) runs its first iteration with its initial buckets, whose parameter
order differs from the rebuilt buckets the state was saved with, so those buffers would land on the
wrong parameters. :class:`ResumablePowerSGD` records each bucket's parameters, saves the state
cut into per-parameter pieces, and assembles them again in whatever layout the buckets have.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_memopt.private_api import powersgd_compresses

_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression")


class ResumablePowerSGD:
    """``powerSGD_hook`` that remembers each bucket's parameters, with a state dict per parameter.

    When DDP rebuilds its buckets (after its first iteration), the state is carried over to the
    new layout the same way. Off NCCL (gloo) each bucket's communication finishes before the next
    bucket's starts, so the ranks issue their collectives in one order.

    Register it with its ``state``: ``ddp.register_comm_hook(hook.state, hook)``.

    Example::

        >>> model = nn.Linear(4, 3)
        >>> hook = ResumablePowerSGD(powersgd.PowerSGDState(None, start_powerSGD_iter=2), model)
        >>> hook.state_dict()["iter"]
        0
    """

    def __init__(self, state: powersgd.PowerSGDState, model: nn.Module) -> None:
        self.state = state
        self.__name__ = self.__qualname__ = "resumable_powerSGD_hook"  # DDP logs a hook by its name
        self.shapes = [tuple(parameter.shape) for parameter in model.parameters()]
        self._position = {id(parameter): index for index, parameter in enumerate(model.parameters())}
        self.layouts: dict[int, tuple[int, ...]] = {}  # bucket index → parameter positions, in bucket order
        self._pending: dict[str, dict[int, torch.Tensor]] | None = None  # restored pieces not placed yet

    def __call__(self, state, bucket):  # unannotated: DDP rejects string annotations of a hook
        index = bucket.index()
        layout = tuple(self._position[id(parameter)] for parameter in bucket.parameters())
        if self.layouts.get(index, layout) != layout and self._pending is None:  # DDP rebuilt its buckets
            self._pending = self._pieces(to_host=False)
            self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict = {}, {}, {}
        self.layouts[index] = layout
        if self._pending is not None:
            self._place(index, layout, bucket.buffer())
        future = powersgd.powerSGD_hook(state, bucket)
        if bucket.buffer().device.type == "cpu" or "nccl" not in str(dist.get_backend(state.process_group)):
            # gloo runs the second all-reduce (Q) from its own thread: without a wait, two buckets'
            # collectives can interleave in a different order on each rank
            future.wait()
        return future

    def state_dict(self) -> dict[str, Any]:
        """Counters, RNG and per-parameter pieces (``error``, ``p``, ``q``), on the CPU; loads with ``weights_only``."""
        saved: dict[str, Any] = {name: int(getattr(self.state, name)) for name in _COUNTERS}
        saved["rng"] = _rng_state(self.state.rng)
        saved.update(self._pieces(to_host=True))
        return saved

    def _pieces(self, to_host: bool) -> dict[str, dict[int, torch.Tensor]]:
        """The state's flat bucket buffers cut into per-parameter pieces, by parameter position."""
        pieces: dict[str, dict[int, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}
        for bucket, layout in self.layouts.items():
            parts = [("error", self.state.error_dict, [(i, _numel(self.shapes[i])) for i in layout])]
            compressed = self._compressed(layout)
            parts.append(("p", self.state.p_memory_dict, [(i, size) for i, size, _ in compressed]))
            parts.append(("q", self.state.q_memory_dict, [(i, size) for i, _, size in compressed]))
            for key, memory, sizes in parts:
                if bucket in memory:
                    split = torch.split(memory[bucket], [size for _, size in sizes])
                    pieces[key].update(
                        (i, piece.detach().clone().cpu() if to_host else piece)
                        for (i, _), piece in zip(sizes, split, strict=True)
                    )
        return pieces

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a :meth:`state_dict`; the pieces are placed when each bucket is next communicated."""
        for name in _COUNTERS:
            setattr(self.state, name, int(saved[name]))
        _set_rng_state(self.state.rng, saved["rng"])
        self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict = {}, {}, {}
        self._pending = {key: dict(saved[key]) for key in ("error", "p", "q")}

    def _place(self, bucket: int, layout: tuple[int, ...], buffer: torch.Tensor) -> None:
        """Assemble the restored pieces of ``layout``'s parameters into this bucket's flat buffers."""
        assert self._pending is not None
        pending = self._pending
        if all(i in pending["error"] for i in layout):
            self.state.error_dict[bucket] = torch.cat([pending["error"].pop(i) for i in layout]).to(buffer)
        compressed = [piece[0] for piece in self._compressed(layout)]
        for key, memory in (("p", self.state.p_memory_dict), ("q", self.state.q_memory_dict)):
            if compressed and all(i in pending[key] for i in compressed):
                memory[bucket] = torch.cat([pending[key].pop(i) for i in compressed]).to(buffer)
        if not any(pending.values()):
            self._pending = None

    def _compressed(self, layout: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """``(position, P size, Q size)`` of the parameters PowerSGD compresses, in the order of its P / Q buffers.

        The same test as torch's hook; like it, the matrices are grouped by shape (groups in order
        of first appearance), each group in bucket order.
        """
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for index in layout:
            shape = self.shapes[index]
            rows = shape[0] if shape else 1
            columns = _numel(shape) // max(rows, 1)
            rank = min(rows, columns, self.state.matrix_approximation_rank)
            if powersgd_compresses(rows, columns, rank, self.state.min_compression_rate):
                groups.setdefault((rows, columns), []).append((index, rows * rank, columns * rank))
        return [entry for group in groups.values() for entry in group]


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    kind, keys, position, has_gauss, cached_gaussian = rng.get_state()
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_rng_state(rng: np.random.RandomState, saved: dict[str, Any]) -> None:
    keys = saved["keys"].numpy().astype(np.uint32)
    rng.set_state((saved["kind"], keys, saved["position"], saved["has_gauss"], saved["cached_gaussian"]))
