"""A training step's time under several checkpointing policies, as the planner prices it, from fake-mode profiles.

Each policy's step is profiled in fake mode (its work, recomputation included, and the bytes it
offloads); the blocks it wraps are priced for the host from a profile without checkpointing (their
calls and forward ops), and so is the copy schedule of the blocks it offloads;
:func:`~lightning_memopt.planner.cost.step_cost` turns all of it into seconds on ``hardware``.
Forward and backward of one batch, no optimizer step (what ``gpu_truth.py`` times).

Example::

    >>> import torch
    >>> from lightning_memopt.models import create_model
    >>> from lightning_memopt.planner import gpu
    >>> costs = predicted_step_costs(lambda: create_model("iresnet_tiny"), torch.randn(2, 3, 32, 32),
    ...     gpu("h100_80gb"), {"none": None, "full": "preset"}, loss_fn=lambda model, x: model(x).sum())
    >>> costs["full"].total > costs["none"].total, costs["full"].bound
    (True, 'host')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing import PolicySpec, checkpoint_modules
from lightning_memopt.memory import profile_step
from lightning_memopt.memory.work import Work
from lightning_memopt.planner.cost import StepCost, step_cost
from lightning_memopt.planner.estimate import checkpointed_regions, copy_schedule
from lightning_memopt.planner.hardware import Hardware
from lightning_memopt.planner.offload_price import OffloadedBlock


@dataclass(frozen=True)
class ProfiledStep:
    """One policy's step as a fake-mode profile counted it: its work (recomputation included), the bytes it
    offloads, by mode the calls and forward ops of the blocks it checkpoints, and where it offloads, its blocks
    for the copy schedule; :meth:`cost` prices it."""

    work: Work
    offloaded_bytes: float
    regions: dict[str, tuple[int, float]]
    copies: tuple[OffloadedBlock, ...] = ()

    def cost(self, hardware: Hardware) -> StepCost:
        """Its seconds on ``hardware``."""
        return step_cost(
            self.work, Work(), hardware, offloaded_bytes=self.offloaded_bytes, regions=self.regions, copies=self.copies
        )


def profiled_steps(
    build: Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    policies: Mapping[str, PolicySpec | None],
    precision: str = "32-true",
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, ProfiledStep]:
    """The step of ``build()`` on ``batch`` under each policy of ``policies`` (``None``: no checkpointing), profiled
    for ``hardware``'s device (its autocast lists and workspaces).

    ``loss_fn(model, batch)``: the loss (default: a LightningModule's ``training_step``).
    """
    wrapped = {name: _modes(build, policy) for name, policy in policies.items()}
    blocks = tuple(dict.fromkeys(block for modes in wrapped.values() for block in modes))
    anchor = _profile(build, batch, hardware, precision, None, loss_fn, blocks)
    steps = {}
    for name, policy in policies.items():
        profile = anchor if policy is None else _profile(build, batch, hardware, precision, policy, loss_fn, ())
        steps[name] = ProfiledStep(
            profile.work(("forward", "backward")),
            float(profile.offloaded_bytes),
            checkpointed_regions(anchor, wrapped[name]),
            copy_schedule(anchor, wrapped[name]),
        )
    return steps


def predicted_step_costs(
    build: Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    policies: Mapping[str, PolicySpec | None],
    **profiling: Any,
) -> dict[str, StepCost]:
    """The priced step of each policy on ``hardware``; ``profiling``: :func:`profiled_steps`' ``precision`` and
    ``loss_fn``."""
    steps = profiled_steps(build, batch, hardware, policies, **profiling)
    return {name: step.cost(hardware) for name, step in steps.items()}


def _modes(build: Callable[[], nn.Module], policy: PolicySpec | None) -> dict[str, str]:
    return {} if policy is None else dict(checkpoint_modules(build(), policy).modules)


def _profile(
    build: Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    precision: str,
    policy: PolicySpec | None,
    loss_fn: Callable[[nn.Module, Any], Any] | None,
    blocks: tuple[str, ...],
) -> Any:
    prepare = (lambda model: checkpoint_modules(model, policy)) if policy is not None else None
    return profile_step(
        build,
        batch,
        mode="fake",
        precision=precision,
        steps=1,
        prepare_model=prepare,
        loss_fn=loss_fn,
        optimizer=_unpriced_optimizer,
        blocks=blocks,
        device_type=hardware.device_type,
        workspace=hardware.workspace,
        host_is_device=hardware.host_is_device,
    )


def _unpriced_optimizer(parameters: Any) -> torch.optim.Optimizer:
    # the profile needs an optimizer; its step is not priced (forward and backward only), so any will do
    return torch.optim.SGD(parameters, lr=0.0)
