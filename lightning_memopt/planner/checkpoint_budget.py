"""plan_checkpointing(): the fastest per-block checkpointing of a model within an activation budget.

One fake-mode profile of a training step prices every block's options; the checkpointing frontier
(:mod:`~lightning_memopt.planner.frontier`) picks. ``ActivationCheckpointing({"budget": b})`` runs it
in a fit. A block with a lean recomputation of its own (:class:`~lightning_memopt.models.structure.LeanRecompute`)
is weighed both ways: ``"full"`` (plain, one forward again) and ``"lean"`` (less held again, more work).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing.policy import BlocksSpec, Policy, check_blocks, check_budget
from lightning_memopt.memory.profile import LossFn, OptimizerSource, profile_step
from lightning_memopt.memory.step_parts import is_lightning_module
from lightning_memopt.models.structure import LeanRecompute, lean_recompute
from lightning_memopt.planner.calibration import measure_cpu
from lightning_memopt.planner.frontier import ActivationPeaks, Frontier, block_options
from lightning_memopt.planner.hardware import Hardware, cuda_hardware
from lightning_memopt.selection import describe_model
from lightning_memopt.vocabulary import format_bytes


@dataclass(frozen=True)
class CheckpointChoice:
    """What :func:`plan_checkpointing` picked: a mode per block, and the activation peaks it was planned with.

    ``activation_bytes`` and ``unchecked_activation_bytes`` are the knapsack's counts (offloaded
    outputs of neighbours not counted); ``fits``: the choice meets ``target_bytes`` (else it is the
    one with the least activation peak).
    """

    modes: dict[str, str]
    target_bytes: int
    activation_bytes: int
    unchecked_activation_bytes: int
    seconds: float  # what the choice adds to a step, by the cost model

    @property
    def fits(self) -> bool:
        return self.activation_bytes <= self.target_bytes

    def policy(self) -> list[dict[str, str]]:
        """The policy for :func:`~lightning_memopt.checkpointing.apply_activation_checkpointing` (empty: nothing to
        checkpoint)."""
        return [{"modules": name, "mode": mode} for name, mode in self.modes.items()]

    def describe(self) -> str:
        """``"full ×3, selective ×1: activations 1.20 GiB of 3.10 GiB (target 1.30 GiB)"``."""
        counts: dict[str, int] = {}
        for mode in self.modes.values():
            counts[mode] = counts.get(mode, 0) + 1
        chosen = ", ".join(f"{mode} ×{count}" for mode, count in counts.items()) or "nothing checkpointed"
        return (
            f"{chosen}: activations {format_bytes(self.activation_bytes)} of "
            f"{format_bytes(self.unchecked_activation_bytes)} (target {format_bytes(self.target_bytes)})"
        )


def lean_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> dict[str, LeanRecompute]:
    """The lean recomputation each of ``blocks`` declares (:func:`~lightning_memopt.checkpointing.lean_recompute`)."""
    found = {name: lean_recompute(module) for name, module in blocks}
    return {name: cost for name, cost in found.items() if cost is not None}


def _plain_sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.0)


def budget_bytes(budget: Any, unchecked: int) -> int:
    """``budget`` as bytes: a fraction in (0, 1] of ``unchecked`` activation bytes, or a number of bytes above 1.

    Raises:
        ValueError: not a positive number (a bool neither).

    Example::

        >>> budget_bytes(0.25, 1000), budget_bytes(300, 1000)
        (250, 300)
    """
    budget = check_budget(budget)
    return int(budget * unchecked) if budget <= 1 else int(budget)


def plan_checkpointing(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    budget: float,
    *,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    precision: str = "32-true",
    hardware: Hardware | None = None,
    blocks: BlocksSpec = "auto",
) -> CheckpointChoice:
    """The fastest per-block checkpointing of ``model`` whose activation peak on ``batch`` is within ``budget``.

    One fake-mode profile of a step (nothing allocated) prices each block's options; :class:`Frontier`
    picks. Apply the result with ``apply_activation_checkpointing(model, choice.policy())``. A block
    with a lean recomputation is weighed plain (``"full"``) and lean (``"lean"``): at a budget the
    plain one meets, that is the faster.

    Args:
        model: an ``nn.Module`` (a LightningModule uses its ``training_step``) or a function building one.
        batch: one training batch.
        budget: a fraction in (0, 1] of the activation peak without checkpointing, or bytes (above 1).
        loss_fn / optimizer: as :func:`~lightning_memopt.memory.profile_step` takes them (the optimizer
            does not change the activations: a plain module without one is profiled with SGD).
        precision: the precision the step runs at (a Lightning precision string).
        hardware: the device whose rates price the options; default this machine's CUDA device, else
            this CPU, timed.
        blocks: the modules to choose for: ``"auto"`` (declared, else discovered) or classes, paths, globs.

    Raises:
        ValueError: a bad ``budget`` or ``blocks``, or no blocks to choose for.

    Example::

        >>> import torch
        >>> from lightning_memopt.models import create_model
        >>> from lightning_memopt.planner import gpu
        >>> choice = plan_checkpointing(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48), 0.5,
        ...     loss_fn=lambda m, x: m(x).square().mean(), hardware=gpu("a100_80gb"))
        >>> choice.fits, choice.activation_bytes <= choice.unchecked_activation_bytes // 2
        (True, True)
    """
    check_blocks(blocks)
    factory = (lambda: model) if isinstance(model, nn.Module) else model
    if not callable(factory):
        raise TypeError(f"`model` must be an nn.Module or a function building one, got {type(model).__name__}")
    with torch.device("meta"):
        described = factory() if not isinstance(model, nn.Module) else model
    matches = Policy(blocks).matches(described)
    names = [name for name, _ in matches]
    lean = lean_blocks(matches)
    if not names:
        raise ValueError(f"no blocks to checkpoint for `blocks`={blocks!r}: {describe_model(described)}")
    if optimizer is None and not is_lightning_module(described):
        optimizer = _plain_sgd
    if hardware is None:
        cuda = torch.cuda.is_available()
        hardware = cuda_hardware(torch.device("cuda", torch.cuda.current_device())) if cuda else measure_cpu(0)
    anchor = profile_step(
        factory, batch, loss_fn=loss_fn, optimizer=optimizer, mode="fake", precision=precision, steps=1,
        blocks=tuple(names), device_type=hardware.device_type, workspace=hardware.workspace,
        host_is_device=hardware.host_is_device,
    )  # fmt: skip
    frontier = Frontier(block_options(anchor, names, hardware, lean=lean), ActivationPeaks.of(anchor))
    target = budget_bytes(budget, frontier.peaks.unchecked)
    modes = frontier.fastest(target)
    if modes is None:  # out of reach: the least activation peak there is
        modes = frontier.fastest(frontier.least_bytes()) or {}
    return CheckpointChoice(modes, target, frontier.peak(modes), frontier.peaks.unchecked, frontier.seconds(modes))
