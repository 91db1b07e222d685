"""A training step's time under several checkpointing policies, as the planner prices it, from fake-mode profiles.

Each policy's step is profiled in fake mode (its work, recomputation included, and the bytes it
offloads); the blocks it wraps are priced for the host from a profile without checkpointing (their
calls and forward kernels); :func:`~lightning_memopt.planner.cost.step_cost` turns both into seconds
on ``hardware``. Forward and backward of one batch, no optimizer step (what ``gpu_truth.py`` times).

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
from typing import Any

import torch
from torch import nn

from lightning_memopt.checkpointing import PolicySpec, checkpoint_modules
from lightning_memopt.memory import profile_step
from lightning_memopt.memory.work import Work
from lightning_memopt.planner.cost import StepCost, step_cost
from lightning_memopt.planner.hardware import Hardware


def predicted_step_costs(
    build: Callable[[], nn.Module],
    batch: Any,
    hardware: Hardware,
    policies: Mapping[str, PolicySpec | None],
    precision: str = "32-true",
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, StepCost]:
    """The priced step of ``build()`` on ``batch`` under each policy of ``policies`` (``None``: no checkpointing).

    ``loss_fn(model, batch)``: the loss (default: a LightningModule's ``training_step``).
    """
    wrapped = {name: _modes(build, policy) for name, policy in policies.items()}
    blocks = tuple(dict.fromkeys(block for modes in wrapped.values() for block in modes))
    anchor = _profile(build, batch, hardware, precision, None, loss_fn, blocks)
    costs = {}
    for name, policy in policies.items():
        profile = anchor if policy is None else _profile(build, batch, hardware, precision, policy, loss_fn, ())
        regions: dict[str, tuple[int, float]] = {}
        for block, mode in wrapped[name].items():
            account = anchor.blocks.get(block)
            calls, kernels = regions.get(mode, (0, 0.0))
            forward = anchor.work(("forward",), (block,)).kernels
            regions[mode] = (calls + (account.calls if account is not None else 0), kernels + forward)
        costs[name] = step_cost(
            profile.work(("forward", "backward")),
            Work(),
            hardware,
            offloaded_bytes=float(profile.offloaded_bytes),
            regions=regions,
        )
    return costs


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
