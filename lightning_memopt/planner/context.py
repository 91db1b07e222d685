"""What a search knows and does at every turn: profile a configuration, and price a step as candidates in each layout.

:class:`SearchContext` holds the inputs of :func:`~lightning_memopt.plan` (model, batch, device,
layouts, the blocks checkpointing chooses for) and what the search has found so far: the
candidates weighed, the groups skipped or refused, and the profiles run.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from torch import nn

from lightning_memopt.batch_slicing import batch_size, slice_batch
from lightning_memopt.checkpointing import LeanRecompute, apply_activation_checkpointing
from lightning_memopt.memory.profile import LossFn, MemoryProfile, OptimizerSource, profile_step
from lightning_memopt.memory.step_parts import quiet_logger
from lightning_memopt.models.structure import set_attention
from lightning_memopt.planner.cost import step_cost
from lightning_memopt.planner.estimate import StepEstimate
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.report import Candidate
from lightning_memopt.planner.sharding import (
    UNSHARDED,
    ShardedModel,
    ShardedTraffic,
    Sharding,
    sharded_estimate,
    sharded_traffic,
)

ROUND_TO = 512  # the profiles count each tensor in 512-byte blocks, as the CUDA caching allocator


@dataclass
class SearchContext:
    """The inputs of one search and what it has found so far."""

    model: Callable[[], nn.Module]
    batch: Any
    loss_fn: LossFn | None
    optimizer: OptimizerSource | None
    hardware: Hardware
    limit: int
    layouts: list[Sharding]  # the FSDP shard degrees and CPU offload considered, unsharded first
    sharded_model: ShardedModel | None  # its FSDP units (None: no sharding considered)
    gather_as_stored: bool  # fsdp_memopt gathers units as stored under mixed precision (PrecisionSwitch's)
    block_spec: Any  # the policy's modules: "auto" or the classes, paths and globs given as `blocks`
    blocks: list[str]  # the blocks checkpointing chooses for
    lean: dict[str, LeanRecompute]  # those with a lean recomputation of their own, and its cost
    trainable_bytes: int
    progress: ProfileProgress | None
    profiles: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[Knobs, float]] = field(default_factory=list)
    rejected: list[tuple[Knobs, str]] = field(default_factory=list)
    smallest_rejected: tuple[int, str] | None = None  # the largest micro-batch the model refused, and why

    def profile(self, knobs: Knobs, model: Callable[[], nn.Module] | None = None, batch: Any = None) -> MemoryProfile:
        """A fake-mode profile of one step with ``knobs`` applied (of another model or batch, if given)."""
        batch = self.batch if batch is None else batch
        if knobs.micro_batch_size is not None:
            batch = slice_batch(batch, 0, knobs.micro_batch_size)

        def prepare(model: nn.Module) -> None:
            set_attention(model, knobs.attn_impl)
            policy = knobs.checkpoint_policy(self.block_spec)
            if policy is not None:
                with quiet_logger("lightning_memopt.checkpointing"):  # "wrapped N modules", once per profile
                    apply_activation_checkpointing(model, policy)

        if self.progress is not None:
            self.progress.set_postfix_str(knobs.describe())
        result = profile_step(
            self.model if model is None else model,
            batch,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            mode="fake",
            precision=knobs.precision,
            steps=1,
            warm_optimizer=True,
            prepare_model=prepare,
            round_to=ROUND_TO,
            blocks=tuple(self.blocks) if knobs.checkpoint == "none" and model is None else (),
            device_type=self.hardware.device_type,
            workspace=self.hardware.workspace,
            host_is_device=self.hardware.host_is_device,
        )
        self.profiles += 1
        if self.progress is not None:
            self.progress.update(1)
        return result

    def micro_batches(self, knobs: Knobs) -> int:
        size = batch_size(self.batch)
        return 1 if knobs.micro_batch_size is None else math.ceil(size / knobs.micro_batch_size)

    def accumulation_bytes(self, knobs: Knobs) -> int:
        # micro-batches after the first run their backward with the accumulated gradients alive
        return self.trainable_bytes if knobs.micro_batch_size is not None else 0

    def candidate(self, knobs: Knobs, estimate: StepEstimate, how: str) -> Candidate:
        """``knobs`` with ``estimate`` of the step unsharded: sharded as the knobs say, priced, listed."""
        traffic = self.traffic(knobs)
        if knobs.sharding.active:
            estimate = self.sharded(knobs, estimate)
            how = "sharded" if how == "profiled" else how
        cost = step_cost(
            estimate.step_work,
            estimate.optimizer_work,
            self.hardware,
            micro_batches=self.micro_batches(knobs),
            offloaded_bytes=estimate.offloaded_bytes,
            traffic=traffic,
            regions=estimate.regions,
            copies=estimate.copies,
        )
        found = Candidate(knobs, estimate, cost, estimate.peak_bytes <= self.limit, how)
        self.candidates.append(found)
        return found

    def sharded(self, knobs: Knobs, estimate: StepEstimate) -> StepEstimate:
        """One rank's ``estimate`` (of the step unsharded) under ``knobs``' sharding."""
        if self.sharded_model is None:
            return estimate
        return sharded_estimate(estimate, self.sharded_model, self._sharding(knobs), knobs.precision)

    def traffic(self, knobs: Knobs) -> ShardedTraffic:
        """What ``knobs``' sharding moves per micro-batch, and the share of the optimizer step left on the device."""
        if self.sharded_model is None:
            return UNSHARDED
        return sharded_traffic(self.sharded_model, self._sharding(knobs), knobs.precision)

    def _sharding(self, knobs: Knobs) -> Sharding:
        return replace(knobs.sharding, gather_as_stored=self.gather_as_stored)

    def candidates_of(self, knobs: Knobs, estimate: StepEstimate, how: str) -> list[Candidate]:
        """``knobs`` (unsharded) in every layout considered."""
        return [
            self.candidate(replace(knobs, shards=layout.shards, cpu_offload=layout.cpu_offload), estimate, how)
            for layout in self.layouts
        ]


class ProfileProgress:
    """How a plan's profiling shows its progress: tqdm's bar on a terminal; elsewhere (a cluster's log file) a line
    at most every ``every`` seconds and one at the end, not one per profile.

    Example::

        >>> import io
        >>> out = io.StringIO()
        >>> progress = ProfileProgress(out)
        >>> for knobs in ("32-true", "bf16-mixed"):
        ...     progress.set_postfix_str(knobs)
        ...     progress.update(1)
        >>> progress.close()
        >>> out.getvalue().startswith("memopt-plan: profiled 2 candidates in ")
        True
    """

    LABEL = "memopt-plan: profiling candidates"

    def __init__(self, stream: TextIO | None = None, every: float = 30.0) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.every = every
        self.bar = None
        if self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=self.LABEL, unit="profile", total=None, leave=False, file=self.stream)
        self.count = 0
        self.started = self.shown = time.monotonic()
        self.current = ""

    def set_postfix_str(self, text: str) -> None:
        self.current = text
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def update(self, count: int) -> None:
        self.count += count
        if self.bar is not None:
            self.bar.update(count)
        elif time.monotonic() - self.shown >= self.every:
            self.shown = time.monotonic()
            elapsed = self.shown - self.started
            print(f"{self.LABEL}: {self.count} in {elapsed:.0f} s (now {self.current})", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            elapsed = time.monotonic() - self.started
            print(f"memopt-plan: profiled {self.count} candidates in {elapsed:.1f} s", file=self.stream, flush=True)
