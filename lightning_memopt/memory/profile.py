"""profile_step(): one training step's memory — measured, or predicted without allocating anything."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.autocast_lists import CudaAutocastLists
from lightning_memopt.memory.report import top_rows
from lightning_memopt.memory.step_parts import (
    LossFn,
    ModelSource,
    OptimizerSource,
    build_optimizer,
    create_optimizer_state,
    device_of,
    materialise,
    quiet_logging,
    tensors,
    training_step_fn,
)
from lightning_memopt.memory.tracker import (
    CATEGORIES,
    PARAMETER_CAST,
    BlockAccount,
    MemorySnapshot,
    MemoryTracker,
)
from lightning_memopt.memory.work import Work, WorkCounter, sum_work
from lightning_memopt.memory.workspace import LibraryWorkspace
from lightning_memopt.private_api import FakeTensorMode, disable_current_modes, tree_map
from lightning_memopt.vocabulary import GIB, PROFILE_PRECISIONS

DEVICE_TYPES = ("cpu", "cuda")  # the autocast op lists a profile can follow
MODES = ("real", "fake")
_HALF = {"bf16": torch.bfloat16, "16": torch.float16}


@dataclass
class TensorInfo:
    """One large live tensor at the peak."""

    nbytes: int
    category: str
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class MemoryProfile:
    """The memory of one training step: the peak and what it is made of."""

    peak_bytes: int
    breakdown: dict[str, int]
    activations_by_module: dict[str, int]
    peak_phase: str
    mode: str
    precision: str
    largest: list[TensorInfo] = field(default_factory=list)
    offloaded_bytes: int = 0  # the most host memory that offloaded activations held at once
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the most live bytes in each phase
    # by category: each phase's peak, ``"<phase> less gradients"`` (the phase at its most bytes other than
    # gradients), and ``"backward end"`` (what the last step's backward pass left)
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict)
    parameter_casts: dict[str, int] = field(default_factory=dict)  # autocast's copies of parameters, at those moments
    work_counts: dict[tuple[str, str], Work] = field(default_factory=dict)  # per step, by (phase, block)
    blocks: dict[str, BlockAccount] = field(default_factory=dict)  # what each named block leaves for backward
    activations_by_block: dict[str, int] = field(default_factory=dict)  # at the peak, per tracked block

    def work(self, phases: tuple[str, ...] | None = None, blocks: tuple[str, ...] | None = None) -> Work:
        """The work of one step in the given phases and blocks (all when ``None``)."""
        return sum_work(self.work_counts, phases, blocks)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def table(self) -> str:
        """A plain-text table: the peak, its breakdown and the activations of each top-level module."""
        lines = [
            f"peak {self.peak_bytes / GIB:.3f} GiB ({self.peak_bytes:,} B) in {self.peak_phase}; "
            f"mode={self.mode}, precision={self.precision}",
            f"{'category':<24}{'GiB':>10}{'share':>8}",
        ]
        for category, nbytes in self.breakdown.items():
            share = nbytes / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"{category:<24}{nbytes / GIB:>10.3f}{share:>8.1%}")
        if self.activations_by_module:
            lines.append(f"{'activations by module':<24}{'GiB':>10}")
            lines += [f"  {name:<22}{nbytes / GIB:>10.3f}" for name, nbytes in top_rows(self.activations_by_module)]
        if self.activations_by_block:
            lines.append(f"{f'activations by block ({len(self.activations_by_block)})':<24}{'GiB':>10}")
            lines += [f"  {name:<22}{nbytes / GIB:>10.3f}" for name, nbytes in top_rows(self.activations_by_block)]
        return "\n".join(lines)


def profile_step(
    model: ModelSource,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    mode: str = "real",
    precision: str = "32-true",
    steps: int = 2,
    prepare_model: Callable[[nn.Module], Any] | None = None,
    round_to: int = 1,
    warm_optimizer: bool = False,
    blocks: tuple[str, ...] | str = (),
    host_parameters: bool = False,
    device_type: str | None = None,
    workspace: LibraryWorkspace | None = None,
    host_is_device: bool | None = None,
) -> MemoryProfile:
    """Run ``steps`` full training steps (forward, loss, backward, optimizer) and profile their memory.

    A ``LightningModule`` supplies its own ``training_step`` and ``configure_optimizers``; a plain
    module needs ``loss_fn(model, batch) -> loss`` and ``optimizer``. The peak is taken over all
    steps (two by default, so optimizer state created by the first step is present in the second).

    ``mode="real"`` runs the step: on CUDA the peak is the caching allocator's; elsewhere it is
    the tensor accounting of :class:`MemoryTracker`. ``mode="fake"`` runs it under
    ``FakeTensorMode``: nothing is allocated (the model may be a factory or live on the meta
    device), so the peak of an 80 GB step is predicted on a laptop. Data-dependent operations
    (``torch.unique``, ``.item()``) cannot run in fake mode.

    Args:
        model: a module, or a zero-argument factory returning one (built on the meta device in fake mode).
        batch: one training batch (tensors, or tuples / lists / dicts of them).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` for plain modules.
        optimizer: an optimizer over ``model``'s parameters, or a factory taking the parameters.
        mode: ``"real"`` or ``"fake"``.
        precision: a Lightning precision string: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``,
            ``"bf16-true"`` or ``"16-true"``.
        steps: training steps to run.
        prepare_model: called on the model before profiling (e.g. to apply activation checkpointing).
        round_to: count each storage rounded up to this many bytes (512 mimics the CUDA allocator).
        warm_optimizer: before profiling, let the optimizer create its state with one step on zero
            gradients, so that a single profiled step (``steps=1``) already sees it.
        blocks: names of submodules whose forward leaves activations for the backward pass, for
            :attr:`MemoryProfile.blocks` (what checkpointing each of them would free), their work and
            :attr:`MemoryProfile.activations_by_block`; ``"auto"``: the model's declared or discovered blocks.
        host_parameters: count the parameters as they are after ``prepare_model``, their gradients
            and optimizer state as host memory (``host_bytes``): an FSDP model offloaded to the CPU
            (``CPUOffloadPolicy``), profiled on a machine whose device is the host itself.
        device_type: the device the step is for, whose autocast op lists a ``-mixed`` precision follows:
            ``"cuda"`` follows CUDA's on the CPU too (fp32 ``layer_norm``, ``softmax``, ``sum``, … where CPU
            autocast keeps bf16; see :mod:`lightning_memopt.memory.autocast_lists`), ``"cpu"`` the CPU's;
            ``None``: the device the module is on.
        workspace: the library workspaces to count beside the tensors (cuBLAS's, cuDNN's: a CUDA
            device's, from its :class:`~lightning_memopt.planner.Hardware`); ``None``: tensors only.
        host_is_device: offloaded copies count in the device's memory (the step's device is the host);
            ``None``: when the step is for a CPU device and ``host_parameters`` is off.

    Raises:
        ValueError: for an unknown ``mode``, ``precision`` or ``device_type``, ``steps`` < 1, or a plain
            module without ``loss_fn`` / ``optimizer``.

    Example::

        >>> layer = nn.Linear(1024, 1024)                         # 4 MiB of fp32 weights
        >>> profile = profile_step(layer, torch.randn(8, 1024), loss_fn=lambda m, x: m(x).sum(),
        ...                        optimizer=lambda params: torch.optim.Adam(params), mode="fake")
        >>> profile.peak_phase
        'optimizer'
        >>> {k: round(v / 2**20, 2) for k, v in profile.breakdown.items() if v}
        {'parameters': 4.0, 'gradients': 4.0, 'optimizer_state': 8.01, 'inputs': 0.03, 'temporaries': 8.0}
    """
    if mode not in MODES:
        raise ValueError(f"Unknown `mode`={mode!r}; valid choices: {', '.join(MODES)}")
    if precision not in PROFILE_PRECISIONS:
        raise ValueError(f"Unknown `precision`={precision!r}; valid choices: {', '.join(PROFILE_PRECISIONS)}")
    if steps < 1:
        raise ValueError(f"`steps`={steps!r} must be at least 1")
    if device_type not in (None, *DEVICE_TYPES):
        raise ValueError(f"Unknown `device_type`={device_type!r}; valid choices: {', '.join(DEVICE_TYPES)}, None")
    if isinstance(blocks, str) and blocks != "auto":
        raise ValueError(f"Unknown `blocks`={blocks!r}; valid choices: 'auto' or a tuple of submodule names")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if mode == "fake" else None
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            # A prediction allocates nothing: a tracker or SimulatedDevice around it (MemoryBudget plans inside the
            # device it plans for) must not count its fake tensors.
            stack.enter_context(disable_current_modes())
        module = materialise(model, fake_mode)
        if prepare_model is not None:
            prepare_model(module)
        half = _HALF.get(precision.split("-")[0])
        if precision.endswith("-true") and half is not None:
            module = module.to(half)
        step = training_step_fn(module, loss_fn)
        opt = build_optimizer(module, optimizer, fake_mode)
        if fake_mode is not None:
            stack.enter_context(fake_mode)
            batch = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
        if precision.endswith("-true") and half is not None:
            batch = tree_map(
                lambda t: t.to(half) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
            )
        device = device_of(module)
        # as Lightning and PrecisionSwitch run it: no weight-cast cache
        autocast = torch.autocast(device.type, dtype=half, enabled=precision.endswith("-mixed"), cache_enabled=False)
        if precision.endswith("-mixed") and device.type == "cpu" and device_type == "cuda":
            # forward and the backward's recomputations: it acts only where CPU autocast is on
            stack.enter_context(CudaAutocastLists(half))
        if warm_optimizer:
            create_optimizer_state(module, opt)
        # on a CPU device a host copy stays in the same memory: offloading activations there frees nothing
        if host_is_device is None:
            host_is_device = (device_type or device.type) == "cpu" and not host_parameters
        tracker = MemoryTracker(round_to=round_to, workspace=workspace, host_is_device=host_is_device)
        if host_parameters:
            tracker.track(module.parameters(), "parameters", op="parameters", host=True)
        tracker.track_module(module)
        tracker.label_gradients_on_arrival(module)
        if blocks == "auto":
            from lightning_memopt.models.structure import model_structure  # models build on memory: imported here

            blocks = tuple(model_structure(module).block_names)
        tracker.track_blocks(module, blocks)
        tracker.track_optimizer(opt)
        tracker.track(tensors(batch), "inputs", op="batch")
        counter = WorkCounter(tracker)
        peak, block_accounts, backward_end = _run_steps(
            module, batch, step, opt, autocast, steps, device, fake_mode is not None, tracker, counter, stack
        )
    result = _profile_from(peak, tracker.peak_host_bytes, mode, precision, device, fake_mode is not None)
    result.phase_peaks = dict(tracker.phase_peaks)
    for phase in result.phase_peaks:
        for key, less_gradients in ((phase, False), (f"{phase} less gradients", True)):
            snapshot = tracker.phase_peak(phase, less_gradients)
            result.phase_breakdowns[key] = snapshot.by_category()
            result.parameter_casts[key] = sum(r.nbytes for r in snapshot.records if r.op == PARAMETER_CAST)
    result.phase_breakdowns["backward end"] = backward_end
    result.work_counts = {key: work.scaled(1 / steps) for key, work in counter.counts.items()}
    for account in block_accounts.values():  # the module hooks counted every step's calls: one step's, as the work
        account.calls = round(account.calls / steps)
    result.blocks = block_accounts
    return result


def _run_steps(
    module: nn.Module,
    batch: Any,
    step: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    autocast: Any,
    steps: int,
    device: torch.device,
    fake: bool,
    tracker: MemoryTracker,
    counter: WorkCounter,
    stack: contextlib.ExitStack,
) -> tuple[MemorySnapshot, dict[str, BlockAccount], dict[str, int]]:
    on_cuda = device.type == "cuda" and not fake
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    stack.enter_context(tracker)
    stack.enter_context(counter)
    stack.callback(tracker.remove_hooks)
    module.train()
    for _ in range(steps):
        with tracker.in_phase("forward"), autocast, quiet_logging():
            loss = step(batch)
        block_accounts = tracker.block_accounts()
        with tracker.in_phase("backward"):
            loss.backward()
        del loss
        tracker.relabel_gradients(module)
        backward_end = tracker.current().by_category()
        with tracker.in_phase("optimizer"):
            optimizer.step()
        tracker.relabel_optimizer_state(optimizer)
        optimizer.zero_grad(set_to_none=True)
    peak = tracker.peak
    if on_cuda:
        peak = MemorySnapshot(torch.cuda.max_memory_allocated(device), peak.phase, peak.records)
    return peak, block_accounts, backward_end


def _profile_from(
    peak: MemorySnapshot, offloaded: int, mode: str, precision: str, device: torch.device, fake: bool
) -> MemoryProfile:
    largest = [
        TensorInfo(r.nbytes, r.category, r.module, r.op, r.shape, str(r.dtype).replace("torch.", ""))
        for r in peak.largest()
    ]
    label = "fake" if fake else f"real-{device.type}"
    return MemoryProfile(
        peak_bytes=peak.total_bytes,
        breakdown=peak.by_category(),
        activations_by_module=peak.activations_by_module(),
        activations_by_block=peak.activations_by_block(),
        peak_phase=peak.phase,
        mode=label,
        precision=precision,
        largest=largest,
        offloaded_bytes=offloaded,
    )


__all__ = [
    "CATEGORIES",
    "MODES",
    "LossFn",
    "MemoryProfile",
    "ModelSource",
    "OptimizerSource",
    "TensorInfo",
    "profile_step",
]
