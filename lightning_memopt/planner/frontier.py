"""The checkpointing frontier: for each block keep, selective, full or offload, the fastest set for any budget.

Each block's choice is priced from the profile of the step without checkpointing (the anchor): the
device bytes it frees until its backward runs, and the seconds it adds (its recomputation, the copy
to the host and back, the host-side cost of a checkpointed call) by the planner's cost model. The
activation peak of a set of choices is the larger of the forward's activations less everything
freed, and the backward's less everything freed but the largest block (re-materialised while its
backward runs). The fastest set within a target is a multiple-choice knapsack, solved exactly by
dynamic programming over the bytes freed, once for each bound on the largest block; bytes are
counted in steps of 1/:data:`RESOLUTION` of what all blocks can free at most, rounded towards less
freed, so a set found always meets its target. PyTorch's min-cut partitioner solves the same kind
of knapsack over the ops of a compiled graph (``activation_memory_budget``); this one acts on eager
models, at the granularity of their blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.memory.work import Work
from lightning_memopt.models.structure import LeanRecompute
from lightning_memopt.planner.cost import step_cost, unhidden_offloads
from lightning_memopt.planner.estimate import STEP_MOMENTS, StepEstimate, freed_bytes, held_bytes, recomputed_work
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.vocabulary import CHECKPOINT_MODES, LEAN, NO_CHECKPOINT

RESOLUTION = 8192  # the byte steps of the knapsack: 1/RESOLUTION of what all blocks can free at most
LARGEST_BOUNDS = 48  # at most this many bounds on the largest block freed are tried (evenly spread over them)


@dataclass(frozen=True)
class BlockOption:
    """One way to treat a block: its mode (``"none"`` keeps it), the bytes it frees until its backward, the seconds
    it adds, the bytes its backward holds again at once (default: those it freed), offloaded, its output's bytes,
    which leave the device too when the next block is offloaded (or none follows), and whether it is a last
    resort, taken only where no other choices reach a target (offload whose copies the link does not hide)."""

    mode: str
    freed_bytes: int
    seconds: float
    held_bytes: int | None = None
    output_bytes: int = 0
    last_resort: bool = False

    @property
    def held(self) -> int:
        return self.freed_bytes if self.held_bytes is None else self.held_bytes


@dataclass(frozen=True)
class ActivationPeaks:
    """The bytes that checkpointing changes: at the forward's peak and at the backward's fullest moment.

    :meth:`of` counts the anchor's activations (an activation budget); :meth:`of_step` every byte of
    a step at those moments (whether the step fits a device).

    Example::

        >>> peaks = ActivationPeaks(forward=100, backward=80)
        >>> peaks.unchecked, peaks.after(freed=60, largest=30)   # max(100 - 60, 80 - 60 + 30)
        (100, 50)
    """

    forward: int
    backward: int

    @classmethod
    def of(cls, anchor: MemoryProfile) -> ActivationPeaks:
        """The anchor's activation bytes."""
        return cls._at_moments({m: b["activations"] for m, b in anchor.phase_breakdowns.items()})

    @classmethod
    def of_step(cls, estimate: StepEstimate) -> ActivationPeaks:
        """All the bytes of ``estimate`` (the anchor's, as :func:`~lightning_memopt.planner.estimate.from_profile`
        gives it) at the step's moments."""
        return cls._at_moments({moment: sum(breakdown.values()) for moment, breakdown in estimate.phases.items()})

    @classmethod
    def _at_moments(cls, nbytes: Mapping[str, int]) -> ActivationPeaks:
        backward = [nbytes[m] for m in STEP_MOMENTS[1:] if m in nbytes]
        return cls(nbytes.get("forward", 0), max(backward, default=0))

    @property
    def unchecked(self) -> int:
        return max(self.forward, self.backward)

    def after(self, freed: int, largest: int) -> int:
        """The activation peak once blocks freeing ``freed`` bytes in all, ``largest`` the most of one, are treated."""
        return max(0, self.forward - freed, self.backward - freed + largest)


def block_options(
    anchor: MemoryProfile,
    blocks: Sequence[str],
    hardware: Hardware,
    micro_batches: int = 1,
    lean: Mapping[str, LeanRecompute] | None = None,
) -> dict[str, tuple[BlockOption, ...]]:
    """Every block of ``blocks`` the anchor saw called, with each way to treat it (keeping it first).

    A mode that frees nothing is left out: offload where the host is the device (``hardware.host_is_device``:
    this CPU), whose host copies stay in the same memory. On a GPU (``device_type`` ``"cuda"``) an offloaded
    block costs its host work and what of its copies the block after it cannot hide
    (:func:`~lightning_memopt.planner.cost.unhidden_offloads`; all of them for the last block), and is a last
    resort where that is anything. An offloaded block's output is counted apart: it leaves the device only when
    the next block is offloaded too. ``lean``: the blocks with a lean recomputation of their own, priced by
    what they declare: each gets a ``"lean"`` option beside plain ``"full"`` (unless it is the plain one: in
    one piece, one forward).

    Example::

        >>> import torch
        >>> from lightning_memopt.memory import profile_step
        >>> from lightning_memopt.models import create_model
        >>> from lightning_memopt.planner import gpu
        >>> anchor = profile_step(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48), mode="fake",
        ...     loss_fn=lambda m, x: m(x).square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), steps=1,
        ...     blocks=("backbone.blocks.0",))
        >>> options = block_options(anchor, ["backbone.blocks.0"], gpu("a100_80gb"))
        >>> [option.mode for option in options["backbone.blocks.0"]]
        ['none', 'full', 'selective', 'offload']
    """
    lean = lean or {}
    unhidden = unhidden_offloads(anchor, blocks, hardware) if hardware.device_type == "cuda" else None
    options = {}
    for name in blocks:
        account = anchor.blocks.get(name)
        if account is None or not account.calls:
            continue
        forward = anchor.work(("forward",), (name,))
        found = [BlockOption(NO_CHECKPOINT, 0, 0.0)]
        cut = name in lean and lean[name].cut
        for mode in (*CHECKPOINT_MODES, LEAN) if cut else CHECKPOINT_MODES:
            if mode == "offload" and hardware.host_is_device:
                continue
            freed = account.saved_bytes if mode == "offload" else freed_bytes(anchor, {name: mode})[name]
            if freed <= 0:
                continue
            cost = step_cost(
                recomputed_work(forward, mode, lean.get(name)),
                Work(),
                hardware,
                micro_batches,
                offloaded_bytes=freed if mode == "offload" and unhidden is None else 0.0,
                regions={mode: (account.calls, forward.ops)},
            )
            waits = unhidden[name] * micro_batches if mode == "offload" and unhidden is not None else 0.0
            output = account.output_bytes if mode == "offload" else 0
            held = held_bytes(anchor, name, freed + output, mode, lean.get(name))
            found.append(BlockOption(mode, freed, cost.total + waits, held, output, last_resort=waits > 0))
        options[name] = tuple(found)
    return options


@dataclass
class Frontier:
    """The fastest per-block choices for any activation target, over ``options`` (from :func:`block_options`).

    Blocks are taken in the order of ``options``: an offloaded block's output leaves the device when
    the next block is offloaded too (the knapsack carries whether the block before was offloaded).
    Options of last resort are taken only for a target that the others cannot reach.

    Example::

        >>> options = {
        ...     "a": (BlockOption("none", 0, 0.0), BlockOption("full", 40, 2.0), BlockOption("selective", 30, 0.5)),
        ...     "b": (BlockOption("none", 0, 0.0), BlockOption("full", 40, 2.0), BlockOption("selective", 10, 0.2)),
        ... }
        >>> frontier = Frontier(options, ActivationPeaks(forward=100, backward=100))
        >>> frontier.fastest(90)   # max(100 - 40, 100 - 40 + 30): a block's backward holds its bytes again
        {'a': 'selective', 'b': 'selective'}
        >>> frontier.fastest(70), frontier.least_bytes()
        ({'a': 'selective', 'b': 'full'}, 60)
    """

    options: Mapping[str, Sequence[BlockOption]]
    peaks: ActivationPeaks
    _tables: dict[tuple[int, bool], np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        most = sum(max(o.freed_bytes + o.output_bytes for o in choices) for choices in self.options.values())
        self.unit = max(1, math.ceil(most / RESOLUTION))
        largest = sorted({o.held for choices in self.options.values() for o in choices if o.held})
        if len(largest) > LARGEST_BOUNDS:  # evenly spread, the most saving kept: any bound gives sets that are valid
            largest = [largest[round(i * (len(largest) - 1) / (LARGEST_BOUNDS - 1))] for i in range(LARGEST_BOUNDS)]
        self.largest_bounds = largest

    def freed(self, modes: Mapping[str, str]) -> int:
        """The bytes ``modes`` (block name → mode; blocks left out are kept) free until the backward pass."""
        total, previous = 0, None
        for name in self.options:
            option = self._option(name, modes.get(name, NO_CHECKPOINT))
            total += option.freed_bytes
            if previous is not None and previous.mode == "offload" and option.mode == "offload":
                total += previous.output_bytes
            previous = option
        return total + (previous.output_bytes if previous is not None and previous.mode == "offload" else 0)

    def peak(self, modes: Mapping[str, str]) -> int:
        """The activation peak of ``modes`` as the knapsack counts it."""
        held = max((self._option(name, mode).held for name, mode in modes.items()), default=0)
        return self.peaks.after(self.freed(modes), held)

    def seconds(self, modes: Mapping[str, str]) -> float:
        """The seconds ``modes`` add to a step."""
        return sum(self._option(name, mode).seconds for name, mode in modes.items())

    def fastest(self, target: int) -> dict[str, str] | None:
        """The fastest choices whose activation peak is at most ``target`` bytes (``None``: no choice reaches it)."""
        if self.peaks.unchecked <= target:
            return {}
        resorts = any(o.last_resort for choices in self.options.values() for o in choices)
        for resort in (False, True) if resorts else (True,):
            best: tuple[float, int, int] | None = None  # (seconds, bound, units needed)
            for bound in self.largest_bounds:
                needed = self._units_needed(target, bound)
                table = self._table(bound, resort)
                if needed < len(table) and np.isfinite(table[needed]) and (best is None or table[needed] < best[0]):
                    best = (float(table[needed]), bound, needed)
            if best is not None:
                return self._choices(best[1], best[2], resort)
        return None

    def least_bytes(self) -> int:
        """The least activation peak any choice reaches (bytes freed counted as the knapsack counts them)."""
        least = self.peaks.unchecked
        for bound in self.largest_bounds:
            reached = np.flatnonzero(np.isfinite(self._table(bound, True)))
            if len(reached):
                least = min(least, self.peaks.after(int(reached[-1]) * self.unit, bound))
        return least

    def points(self, count: int = 32, floor: int = 0) -> list[dict[str, str]]:
        """The distinct fastest choices at ``count`` targets spread evenly from the unchecked peak to the least
        (or to ``floor``, if higher: what checkpointing cannot go below).

        Example::

            >>> options = {name: (BlockOption("none", 0, 0.0), BlockOption("full", 30, 1.0)) for name in "abc"}
            >>> Frontier(options, ActivationPeaks(forward=100, backward=100)).points(4)
            [{'a': 'full', 'b': 'full'}, {'a': 'full', 'b': 'full', 'c': 'full'}]
        """
        high, low = self.peaks.unchecked, max(self.least_bytes(), floor)
        found: list[dict[str, str]] = []
        for index in range(1, count + 1):
            choices = self.fastest(round(high - (high - low) * index / count))
            if choices is not None and choices not in found:
                found.append(choices)
        return found

    def _option(self, name: str, mode: str) -> BlockOption:
        for option in self.options[name]:
            if option.mode == mode:
                return option
        raise ValueError(f"block {name!r} has no option {mode!r}; it has {[o.mode for o in self.options[name]]}")

    def _units_needed(self, target: int, bound: int) -> int:
        """The bytes to free, in knapsack units rounded up, for a peak within ``target`` when no block holds more
        than ``bound`` again."""
        needed = max(self.peaks.forward - target, self.peaks.backward - target + bound, 0)
        return math.ceil(needed / self.unit)

    def _table(self, bound: int, resort: bool) -> np.ndarray:
        """For every number of units, the least seconds that free at least that many (no block over ``bound``;
        options of last resort only with ``resort``)."""
        if (bound, resort) not in self._tables:
            seconds = self._solve(bound, resort)[0].min(axis=0)
            self._tables[bound, resort] = np.minimum.accumulate(seconds[::-1])[::-1]
        return self._tables[bound, resort]

    def _choices(self, bound: int, needed: int, resort: bool) -> dict[str, str]:
        seconds, steps, into_last = self._solve(bound, resort)
        state = needed + int(np.argmin(seconds.min(axis=0)[needed:]))
        offloaded = int(np.argmin(seconds[:, state]))
        if offloaded:  # undo the last block's output
            state = int(into_last[state])
        chosen = {}
        for (name, choices), (picked, before, was_offloaded) in zip(
            reversed(self._allowed(bound, resort)), reversed(steps), strict=True
        ):
            option = choices[picked[offloaded, state]]
            if option.mode != NO_CHECKPOINT:
                chosen[name] = option.mode
            state, offloaded = int(before[offloaded, state]), int(was_offloaded[offloaded, state])
        return dict(reversed(list(chosen.items())))

    def _allowed(self, bound: int, resort: bool) -> list[tuple[str, list[BlockOption]]]:
        return [
            (name, [o for o in choices if o.held <= bound and (resort or not o.last_resort)])
            for name, choices in self.options.items()
        ]

    def _solve(self, bound: int, resort: bool) -> tuple[np.ndarray, list[tuple[np.ndarray, ...]], np.ndarray]:
        """The least seconds to free exactly each number of units (the last: that many or more), by whether the
        last block is offloaded (its output then counted); per block the option picked, and the units and
        offload state before it; and, the last block offloaded, the units before its output."""
        top = RESOLUTION + 1  # the last state holds every sum at least it
        best = np.full((2, top + 1), np.inf)
        best[0, 0] = 0.0
        last_output = 0
        steps = []
        for _, choices in self._allowed(bound, resort):
            merged = np.full((2, top + 1), np.inf)
            picked = np.zeros((2, top + 1), dtype=np.int16)
            before = np.zeros((2, top + 1), dtype=np.int64)
            was_offloaded = np.zeros((2, top + 1), dtype=np.int8)
            for index, option in enumerate(choices):
                offload = int(option.mode == "offload")
                for previous in (0, 1):
                    units = (option.freed_bytes + (last_output if previous and offload else 0)) // self.unit
                    moved, source = _shifted(best[previous], units, top, option.seconds)
                    better = moved < merged[offload]
                    merged[offload][better] = moved[better]
                    picked[offload][better] = index
                    before[offload][better] = source[better]
                    was_offloaded[offload][better] = previous
            best = merged
            last_output = max((o.output_bytes for o in choices if o.mode == "offload"), default=0)
            steps.append((picked, before, was_offloaded))
        # the last block offloaded: its output leaves the device too
        moved, source = _shifted(best[1], last_output // self.unit, top, 0.0)
        return np.stack([best[0], moved]), steps, source


def _shifted(seconds: np.ndarray, units: int, top: int, add: float) -> tuple[np.ndarray, np.ndarray]:
    """``seconds`` moved up by ``units`` (sums past ``top`` kept in the last state) plus ``add``, and the state each
    came from."""
    states = np.arange(top + 1)
    moved = np.full(top + 1, np.inf)
    source = states.copy()
    if units < top:
        moved[units:top] = seconds[: top - units] + add
        source[units:top] = states[: top - units]
    first = max(0, top - units)
    into_last = first + int(np.argmin(seconds[first:]))
    moved[top] = seconds[into_last] + add
    source[top] = into_last
    return moved, source
