"""One rank's memory and traffic under FSDP2 sharding and CPU offload, from the profile of the unsharded step.

The planner profiles a step unsharded (fake mode, one process) and turns it into what one rank of
``fsdp_memopt`` holds, with the planner's categories, at each moment the profile knows
(:data:`~lightning_memopt.planner.estimate.MOMENTS`: the peaks of setup, forward, backward and the
optimizer step, the backward pass at its most bytes other than gradients, and where it ends).
Against the MemoryTracker on real FSDP2 steps on the CPU (gloo, 2 and 4 ranks, fp32 and
bf16-mixed, checkpointed or not; ``tests/planner/sharded_step_run.py``): never under, at most 4 %
over. (This docstring, which writes every term out once, is why the module runs a little over 300 lines.)
Notation (bytes; every tensor rounded up to the allocator's block, as the profile):

- ``N`` shards; ``P`` the parameters as stored, ``G`` the trainable ones (their gradients), ``B``
  the buffers (never sharded: the profile's ``parameters`` less ``P``).
- ``S``: rank 0's shards. FSDP2 splits dim 0 into ``N`` chunks of ``ceil(d0 / N)`` rows (the last
  ones padded) and rank 0 holds a full one. ``S_t``: those of the trainable parameters; ``r = S_t / G``.
- ``U(u)``: unit ``u``'s parameters gathered (rows padded to ``N`` chunks): in bf16 under
  ``bf16-mixed`` run by the Trainer (``MixedPrecisionPolicy``), else as stored: under ``32-true``,
  and when PrecisionSwitch applies the precision (``gather_as_stored``; always for ``16-mixed``,
  which Lightning refuses with ``fsdp_memopt``).
  ``F(u)``: the same in fp32, as gradients are reduce-scattered.
- ``R``: ``ΣU`` of the units that enclose others (the top-level ones: their forward runs around
  the blocks', so they are gathered through forward and backward).
- ``a``, ``b``: the last unit to run forward and the one before it (in the order of
  :func:`~lightning_memopt.strategies.sharding.shard_units`). A step peaks where forward turns into
  backward, with them in flight; with checkpointing too, as measured (a block recomputed later in
  backward has fewer activations around it).
- ``C``: autocast's copies of parameters among the activations (``parameter cast`` storages).
  Units gathered in half precision need none: autocast leaves them as they are.

At every moment, on one rank's device:

- ``optimizer_state × r``; ``gradients × r`` (shards; in forward, earlier micro-batches' gradients).
- ``parameters``: ``B + S``, plus at the step's moments the units in flight: forward
  ``R + 2·U(a)`` (the unit computing and the all-gather buffer FSDP keeps for overlap), backward
  ``R + U(a) + U(b)`` (the unit in backward and the next, prefetched). Without
  ``reshard_after_forward`` every unit stays gathered from its forward to its backward: ``ΣU``.
- backward also ``gradients + U(a) + F(a)``: the unit's unsharded gradients and the fp32
  reduce-scatter input.
- ``activations − C`` when units are gathered in half precision; ``inputs``, ``temporaries`` as
  profiled, but the optimizer step's ``temporaries × r`` (foreach over the local shards).

With CPU offload the shards ``S``, their gradients, the optimizer state and the optimizer step's
temporaries move to the host; the device keeps ``B``, the units in flight, one unit's fp32 shard
copied in (``F(a) / N``; at the backward moments also its reduced shard before the copy back), and
the rest as above. Host memory is the largest of the moments' ``S + gradients × r +
optimizer_state × r (+ temporaries × r)``, plus any offloaded activations. Scalar optimizer state
(AdamW's step count) is scaled like the rest: a few bytes per parameter tensor.

Traffic per micro-batch (:func:`sharded_traffic`): each rank receives ``(N−1)/N`` of every unit
per all-gather (two per step with ``reshard_after_forward``, one without) and of the fp32
gradients once (reduce-scatter); with offload ``S`` crosses the host link per gather and ``S_t``
back once; one collective per unit per gather and reduction, and with offload a copy per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lightning_memopt.arguments import check_bool, check_int
from lightning_memopt.planner.estimate import STEP_MOMENTS, StepEstimate

# the precisions fsdp_memopt gathers units in half precision under, when the Trainer runs them (Lightning refuses
# 16-mixed with it: PrecisionSwitch applies that, and units are gathered as stored)
GATHERED_IN_HALF = ("bf16-mixed",)


@dataclass(frozen=True)
class Sharding:
    """How a step is sharded: over ``shards`` ranks, optionally with the model states in host memory.

    ``gather_as_stored``: units gathered as stored under a mixed precision too (PrecisionSwitch's
    autocast then copies the weights, as unsharded).

    Raises:
        ValueError: ``shards`` below 1, the others neither bools nor words such as ``"on"`` / ``"off"``.
        TypeError: ``shards`` no integer.

    Example::

        >>> Sharding(4, cpu_offload=True).describe()
        'FSDP ×4, CPU offload'
        >>> Sharding(0)
        Traceback (most recent call last):
        ...
        ValueError: `shards` must be an integer ≥ 1, got 0
    """

    shards: int = 1
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    gather_as_stored: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", check_int("shards", self.shards, minimum=1))
        for name in ("cpu_offload", "reshard_after_forward", "gather_as_stored"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))

    @property
    def active(self) -> bool:
        """Whether FSDP runs at all (sharded or offloaded)."""
        return self.shards > 1 or self.cpu_offload

    def describe(self) -> str:
        parts = [f"FSDP ×{self.shards}"] if self.shards > 1 else []
        parts += ["CPU offload"] if self.cpu_offload else []
        parts += ["no reshard after forward"] if self.active and not self.reshard_after_forward else []
        return ", ".join(parts)


@dataclass(frozen=True)
class _Parameter:
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool

    def rows(self, shards: int) -> int:
        return math.ceil(self.shape[0] / shards) if self.shape else 1

    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass(frozen=True)
class _Unit:
    name: str
    parameters: tuple[_Parameter, ...]
    encloses: bool  # holds other units: a top-level unit, whose forward runs around theirs


@dataclass(frozen=True)
class ShardedModel:
    """A model's parameters grouped into its FSDP units (:func:`~lightning_memopt.strategies.sharding.shard_units`).

    Args:
        units: the units in forward order (blocks, then the top-level units), each with the
            parameters no unit before it holds.
        round_to: every tensor rounded up to this many bytes (the allocator's block; the profile's ``round_to``).

    Example::

        >>> from torch import nn
        >>> model = ShardedModel.of(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4)))   # one unit: the root
        >>> model.parameter_bytes(), model.shard_bytes(2)    # (12 + 4 + 16 + 4) · 4 B; 2 of 4 rows each
        (144, 72)
        >>> model.shard_bytes(3), model.shard_bytes(4)       # ceil(4 / 3) = 2 rows on rank 0, as with 2 shards
        (72, 36)
    """

    units: tuple[_Unit, ...]
    round_to: int = 1

    @classmethod
    def of(cls, model: nn.Module, blocks: Any = "auto", round_to: int = 1) -> ShardedModel:
        """The units ``fsdp_memopt`` makes of ``model`` (a plain module or a LightningModule; meta is fine)."""
        from lightning_memopt.strategies.sharding import shard_units

        units = shard_units(model, blocks)
        unit_ids = {id(unit) for _, unit in units}
        seen: set[int] = set()
        found = []
        for name, unit in units:
            own = [p for p in unit.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            parameters = tuple(_Parameter(tuple(p.shape), p.element_size(), p.requires_grad) for p in own)
            encloses = any(id(inner) in unit_ids for inner in unit.modules() if inner is not unit)
            found.append(_Unit(name, parameters, encloses))
        return cls(tuple(found), round_to)

    def _rounded(self, nbytes: float) -> int:
        return -(-int(nbytes) // self.round_to) * self.round_to

    def _parameters(self, trainable_only: bool = False) -> Iterable[_Parameter]:
        return (p for unit in self.units for p in unit.parameters if p.trainable or not trainable_only)

    def parameter_bytes(self, trainable_only: bool = False) -> int:
        """``P`` (``G`` with ``trainable_only``): the parameters as stored, unsharded."""
        return sum(self._rounded(math.prod(p.shape) * p.itemsize) for p in self._parameters(trainable_only))

    def shard_bytes(self, shards: int, trainable_only: bool = False) -> int:
        """``S`` (``S_t``): rank 0's shards of the parameters (of the trainable ones)."""
        return sum(self._rounded(p.rows(shards) * p.row_numel() * p.itemsize) for p in self._parameters(trainable_only))

    def unit_bytes(self, unit: _Unit, shards: int, itemsize: int | None = None) -> int:
        """``U(u)``: ``unit`` gathered (rows padded to ``shards`` chunks), in ``itemsize`` bytes (default as stored)."""
        return sum(
            self._rounded(p.rows(shards) * shards * p.row_numel() * (itemsize or p.itemsize)) for p in unit.parameters
        )

    def trainable_share(self, shards: int) -> float:
        """``r = S_t / G``: the part of the gradients and optimizer state rank 0 holds (and of the optimizer's work)."""
        whole = self.parameter_bytes(trainable_only=True)
        return self.shard_bytes(shards, trainable_only=True) / whole if whole else 0.0

    def in_flight(self) -> tuple[_Unit, _Unit]:
        """``a`` and ``b``: the last two units to run forward (blocks, then top-level units that enclose none)."""
        leaves = [unit for unit in self.units if not unit.encloses and unit.parameters]
        empty = _Unit("", (), False)
        last, before = [*leaves[::-1], empty, empty][:2]
        return last, before


def sharded_estimate(estimate: StepEstimate, model: ShardedModel, sharding: Sharding, precision: str) -> StepEstimate:
    """One rank's estimate of ``estimate`` (an unsharded step) under ``sharding`` (see the module docstring).

    Args:
        estimate: the step unsharded, profiled or estimated.
        model: the model's units.
        sharding: shards, CPU offload, reshard after forward.
        precision: the step's precision: the units are gathered in bf16 under ``bf16-mixed``.
    """
    if not sharding.active:
        return estimate
    n, offload = sharding.shards, sharding.cpu_offload
    ratio, shards = model.trainable_share(n), model.shard_bytes(n)
    itemsize = _gathered_itemsize(sharding, precision)
    last, before_last = model.in_flight()
    a, b = model.unit_bytes(last, n, itemsize), model.unit_bytes(before_last, n, itemsize)
    a_fp32 = model.unit_bytes(last, n, 4)
    top = sum(model.unit_bytes(unit, n, itemsize) for unit in model.units if unit.encloses)
    every = sum(model.unit_bytes(unit, n, itemsize) for unit in model.units)
    from_host = a_fp32 // n if offload else 0  # the shard copied from the host (offload), or the reduced one back
    buffers = max(0, _parameter_total(estimate) - model.parameter_bytes())
    phases: dict[str, dict[str, int]] = {}
    host: dict[str, int] = {}
    for phase, before in estimate.phases.items():
        after = dict(before)
        states = {
            "parameters": shards,
            "gradients": round(before["gradients"] * ratio),
            "optimizer_state": round(before["optimizer_state"] * ratio),
        }
        if phase == "optimizer":
            states["temporaries"] = round(before["temporaries"] * ratio)
        for category in ("gradients", "optimizer_state", "temporaries"):
            if category in states:
                after[category] = 0 if offload else states[category]
        stored = buffers + (0 if offload else shards)
        after["parameters"] = stored
        if phase in STEP_MOMENTS:
            casts = estimate.parameter_casts.get(phase, 0) if itemsize == 2 else 0
            after["activations"] = before["activations"] - casts
            backward = phase != "forward"
            if not sharding.reshard_after_forward:
                after["parameters"] += every + from_host
            else:
                after["parameters"] += top + (a + b if backward else 2 * a) + from_host
            if backward:
                after["gradients"] += a + a_fp32 + from_host
        phases[phase] = after
        if offload and sum(states.values()) > sum(host.values()):
            host = states
    for category, nbytes in estimate.host.items():
        host[category] = host.get(category, 0) + nbytes
    return replace(estimate, phases=phases, host=host)


def _gathered_itemsize(sharding: Sharding, precision: str) -> int | None:
    """Units are gathered in half precision (2 bytes) under a mixed precision the Trainer runs, else as stored."""
    return 2 if precision in GATHERED_IN_HALF and not sharding.gather_as_stored else None


def _parameter_total(estimate: StepEstimate) -> int:
    return max((breakdown.get("parameters", 0) for breakdown in estimate.phases.values()), default=0)


@dataclass(frozen=True)
class ShardedTraffic:
    """Bytes one rank moves per micro-batch under a sharding: over the peer link and over the host link."""

    peer_bytes: float  # all-gathers received and the reduce-scatter
    host_bytes: float  # offload: parameter shards to the device, gradient shards back
    optimizer_share: float  # the part of the optimizer's work this rank does (its shards)
    optimizer_on_host: bool = False  # CPU offload: the optimizer step runs on the host
    launches: float = 0.0  # collectives and copies issued: one per unit per gather and reduction (offload: per tensor)


UNSHARDED = ShardedTraffic(0.0, 0.0, 1.0)


def sharded_traffic(model: ShardedModel, sharding: Sharding, precision: str) -> ShardedTraffic:
    """The traffic of one micro-batch under ``sharding`` (see the module docstring).

    Example::

        >>> from torch import nn
        >>> model = ShardedModel.of(nn.Linear(4, 4, bias=False))               # 64 B of fp32 weights
        >>> sharded_traffic(model, Sharding(2), "32-true")                      # 2 gathers + 1 reduce, half each
        ShardedTraffic(peer_bytes=96.0, host_bytes=0.0, optimizer_share=0.5, optimizer_on_host=False, launches=3.0)
    """
    if not sharding.active:
        return UNSHARDED
    n = sharding.shards
    gathers = 2 if sharding.reshard_after_forward else 1
    gathered = sum(model.unit_bytes(unit, n, _gathered_itemsize(sharding, precision)) for unit in model.units)
    reduced = sum(model.unit_bytes(unit, n, 4) for unit in model.units)
    peer = (gathers * gathered + reduced) * (n - 1) / n
    host = gathers * model.shard_bytes(n) + model.shard_bytes(n, trainable_only=True) if sharding.cpu_offload else 0
    units = [unit for unit in model.units if unit.parameters]
    launches = len(units) * (gathers + 1)
    if sharding.cpu_offload:
        launches += sum(len(unit.parameters) for unit in units) * (gathers + 1)
    return ShardedTraffic(float(peer), float(host), model.trainable_share(n), sharding.cpu_offload, float(launches))
