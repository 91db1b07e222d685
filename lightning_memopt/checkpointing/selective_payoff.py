"""Whether selective recomputation pays on a block: the time its kept ops save against what its per-op mode costs.

Selective recomputation keeps the outputs of a block's matmuls, convolutions and attention and
recomputes the rest; to know which is which it runs every op of the block through a Python
dispatch mode, in the forward and again in the recomputation. On a block of large matmuls the
kept ops save far more device time than that costs the host; on a block of small ones (a narrow
CNN, tiny tensors, a host-bound step) the mode costs more than it saves, and full recomputation
is faster and needs less memory. So a block checkpointed ``"selective"`` times its kept ops on its
first calls (on the device: CUDA events, or the host's clock on the CPU; the fastest call counts) and compares
them with ``ops × the two modes' cost per op`` (:func:`mode_seconds_per_op`, measured once a process on
this host); where they save less, the block is recomputed in full from then on, and the log says so
once per block class. Profiles in fake mode time nothing and keep the mode as asked (the planner
prices each block's modes itself and never picks a selective block that costs more than full).

The verdict is a module's, made once: a later change of precision, micro-batch size or input shape does not
revisit it. Blocks that go through ``torch.utils.checkpoint`` instead (a block of several inputs taking
gradients that no trace follows, or under ``torch.compile``) keep their expensive ops as asked, with no
verdict. On a GPU the saving is device time and the cost host time: exact where the host sets the step's
pace, cautious where the device does.

Example::

    >>> payoff = SelectivePayoff()
    >>> for _ in range(TIMED_CALLS):
    ...     kept = KeepExpensive(timed=True)
    ...     with kept:
    ...         _ = (torch.randn(4, 4) @ torch.randn(4, 4)).relu()
    ...     payoff.decide(kept, torch.nn.Linear)
    >>> payoff.pays  # a 4×4 matmul saves less than the mode costs the host
    False
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from typing import Any

import torch

from lightning_memopt.checkpointing.selective import KeepExpensive
from lightning_memopt.private_api import TorchDispatchMode

log = logging.getLogger(__name__)


TIMED_CALLS = 4  # a block's first calls are timed, the fastest counts: the very first pays for warm-ups


class SelectivePayoff:
    """One block's verdict: ``None`` until :data:`TIMED_CALLS` calls were timed, then whether keeping pays."""

    def __init__(self) -> None:
        self.pays: bool | None = None
        self._saved: list[float] = []  # each timed call's kept-op seconds

    def decide(self, kept: KeepExpensive, block: type, used: bool = True) -> None:
        """Count a timed :class:`~lightning_memopt.checkpointing.selective.KeepExpensive` run of a block of class
        ``block``, and decide after the last; ``used``: the recomputation replays what it kept (not when a kept
        output was changed in place: then it saved nothing). A run that could not be timed (fake or meta tensors,
        a CUDA graph being captured) counts nothing."""
        saved = kept.kept_seconds()
        if saved is None:
            return
        self._saved.append(saved if used else 0.0)
        if len(self._saved) < TIMED_CALLS:
            return
        saved, cost = min(self._saved), kept.ops * mode_seconds_per_op()
        self.pays = saved > cost
        if not self.pays:
            _log_full_instead(
                block,
                f"its matmuls, convolutions and attention take {saved * 1e3:.3g} ms a call, less than the "
                f"{cost * 1e3:.3g} ms its per-op replay costs the host (full is then faster and needs less memory)",
            )

    def recompute_in_full(self, block: type, first: Any, recomputed: Any) -> None:
        """The recomputation of a block of class ``block`` ran the kept op ``recomputed`` where its first run (autograd
        off) had ``first``: keeping cannot serve it, so it is recomputed in full from now on (said once a class)."""
        if self.pays is not False:
            self.pays = False
            ran = f"ran {first}" if first is not None else "had no more matmuls, convolutions or attention"
            _log_full_instead(
                block,
                f"its recomputation (autograd on) ran {recomputed} where its first run (autograd off) {ran}, so the "
                "kept outputs cannot stand in",
            )


_verdicts: dict[int, SelectivePayoff] = {}  # by id(module): modules need not be hashable


def payoff_of(module: torch.nn.Module) -> SelectivePayoff:
    """The verdict of ``module``: one per module object, kept when its checkpointing is removed and applied again
    (a copy of the module starts afresh)."""
    verdict = _verdicts.get(id(module))
    if verdict is None:
        verdict = _verdicts[id(module)] = SelectivePayoff()
        weakref.finalize(module, _verdicts.pop, id(module), None)
    return verdict


@functools.lru_cache(maxsize=1)
def mode_seconds_per_op(ops: int = 200, rounds: int = 7) -> float:
    """This host's extra time per op of selective's two dispatch modes together: the first run's
    (:class:`~lightning_memopt.checkpointing.selective.KeepExpensive`) and the replay's (the fastest of ``rounds``)."""
    x = torch.ones(4)

    def run(mode: TorchDispatchMode | None = None) -> float:
        started = time.perf_counter()
        with mode if mode is not None else contextlib.nullcontext():
            for _ in range(ops):
                x.add(1.0)
        return time.perf_counter() - started

    plain = min(run() for _ in range(rounds))
    kept = min(run(KeepExpensive()) for _ in range(rounds))
    replayed = min(run(KeepExpensive().replay()) for _ in range(rounds))
    return max(kept + replayed - 2 * plain, 0.0) / ops


_logged: set[type] = set()  # the block classes already named in the log


def _log_full_instead(block: type, why: str) -> None:
    if block in _logged:
        return
    _logged.add(block)
    log.info("selective checkpointing: %s is recomputed in full: %s", block.__name__, why)
