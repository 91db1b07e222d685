"""A compiled step's plan: the largest ``activation_memory_budget`` whose predicted peak fits a memory limit.

``torch.compile`` recomputes what its min-cut partitioner does not save, and saves less as the budget falls (1.0:
what the runtime-optimal cut saves; 0.0: nothing it can recompute). The fastest compiled step that fits is the one
that saves the most within the limit: :func:`plan_compiled` predicts each budget's peak in fake mode
(:func:`~lightning_memopt.memory.compiled_step.predict_compiled_step`), from the largest down, and stops at the first
that fits. :class:`~lightning_memopt.callbacks.CompiledStep` applies a choice (the budget set while the first step
compiles). :func:`weigh_compiled` tries it, and the plan's own checkpointing compiled, against the eager plan on the
device, compiling counted against the run.

Example::

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    >>> loss = lambda model, x: model(x).square().mean()
    >>> roomy = plan_compiled(net, torch.randn(32, 64), loss, limit_bytes=2**20)
    >>> roomy.budget, roomy.fits
    (1.0, True)
    >>> plan_compiled(net, torch.randn(32, 64), loss, limit_bytes=1024).fits
    False
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_memopt.arguments import check_int
from lightning_memopt.memory.allocator import is_oom_error
from lightning_memopt.memory.compiled_step import CompiledStepPeak, predict_compiled_step
from lightning_memopt.memory.profile import LossFn, OptimizerSource
from lightning_memopt.memory.step_parts import training_step_fn
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.report import Plan
from lightning_memopt.planner.trials import Trial, micro_batches
from lightning_memopt.vocabulary import MIB

COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)  # the activation_memory_budget values tried, largest first


@dataclass(frozen=True)
class CompiledPlan:
    """The budget chosen (the largest that fits; the one of least predicted peak when none does) and each budget's
    prediction, in the order tried."""

    budget: float
    fits: bool
    limit_bytes: int
    predictions: list[CompiledStepPeak] = field(default_factory=list)

    @property
    def predicted(self) -> CompiledStepPeak:
        return next(p for p in self.predictions if p.budget == self.budget)

    def describe(self) -> str:
        """``"torch.compile, activation_memory_budget 0.6: 28.20 MiB predicted within 30.00 MiB"``."""
        verdict = "within" if self.fits else "over"
        return (
            f"torch.compile, activation_memory_budget {self.budget:g}: {self.predicted.peak_bytes / MIB:.2f} MiB "
            f"predicted {verdict} {self.limit_bytes / MIB:.2f} MiB"
        )


def plan_compiled(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    limit_bytes: int,
    budgets: Sequence[float] = COMPILE_BUDGETS,
    precision: str = "32-true",
) -> CompiledPlan:
    """The largest of ``budgets`` whose compiled step's predicted activation peak (above weights and the batch;
    gradients included, as a compiled backward returns them together) is at most ``limit_bytes``, the step traced at
    ``precision``.

    Raises:
        ValueError: ``limit_bytes`` below 1, no ``budgets``, or a budget outside [0, 1].
    """
    limit_bytes = check_int("limit_bytes", limit_bytes, minimum=1)
    ordered = sorted({float(budget) for budget in budgets}, reverse=True)
    if not ordered:
        raise ValueError("`budgets` is empty: give at least one activation_memory_budget in [0, 1]")
    predictions: list[CompiledStepPeak] = []
    for budget in ordered:
        predictions.append(predict_compiled_step(model, batch, loss_fn, budget, precision))
        if predictions[-1].peak_bytes <= limit_bytes:
            return CompiledPlan(budget, True, limit_bytes, predictions)
    least = min(predictions, key=lambda prediction: prediction.peak_bytes)
    return CompiledPlan(least.budget, False, limit_bytes, predictions)


@dataclass(frozen=True)
class CompileVerdict:
    """Compiled or eager, and why: each way tried on the device (its fastest step, and a compiled one's first step
    less that: compiling), compiling counted against the steps left to run. ``tried``: label -> (compile seconds,
    step seconds), in the order tried; empty where no compiled way fits."""

    knobs: Knobs
    report: str
    tried: dict[str, tuple[float, float]] = field(default_factory=dict)


EAGER, COMPILED, COMPILED_CHECKPOINTED = "eager", "compiled", "compiled with the plan's checkpointing"


def weigh_compiled(
    plan: Plan,
    module: nn.Module,
    batch: Any,
    device: torch.device,
    *,
    steps_left: int,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerSource | None = None,
    blocks: Any = "auto",
    trial_steps: int = 3,
) -> CompileVerdict:
    """The plan's choice or a compiled way, whichever ends the ``steps_left`` steps sooner, compiling counted.

    The compiled ways: the same knobs with no checkpointing of ours (the compiler recomputes) at the largest
    ``activation_memory_budget`` predicted to fit beside the step's weights, optimizer state and batch; and, where
    the plan checkpoints, the same knobs compiled with its checkpointing (the regions trace into the graph; its
    peak is taken as the eager plan's prediction). Each is tried on ``device`` (a compiled one compiles there,
    timed). Nothing of the run changes.
    """
    eager = plan.chosen
    if eager is None:
        return CompileVerdict(Knobs(), "torch.compile not weighed: nothing to compare with (no plan fits)")
    state = sum(eager.estimate.phases.get("setup", {}).values())
    piece = next(micro_batches(batch, eager.knobs.micro_batch_size))[0]

    def loss(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        return training_step_fn(model, loss_fn)(micro_batch)

    choice = plan_compiled(module, piece, loss, max(1, plan.limit_bytes - state), precision=eager.knobs.precision)
    ways = {EAGER: eager.knobs}
    if choice.fits:
        ways[COMPILED] = replace(
            eager.knobs, checkpoint="none", every_n=1, checkpoint_blocks=(), compile_budget=choice.budget
        )
    offloads = eager.knobs.checkpoint == "offload" or any(
        mode == "offload" for _, mode in eager.knobs.checkpoint_blocks
    )
    if eager.knobs.checkpoint != "none" and not offloads:  # offloaded blocks break the graph: no compiled step there
        ways[COMPILED_CHECKPOINTED] = replace(eager.knobs, compile_budget=1.0)
    if len(ways) == 1:
        return CompileVerdict(
            eager.knobs, f"eager: no compiled step fits ({choice.describe()} beside {state / MIB:.1f} MiB of state)"
        )
    tried = {
        label: _tried(module, batch, knobs, device, loss_fn, optimizer, blocks, trial_steps, plan.limit_bytes)
        for label, knobs in ways.items()
    }
    totals = {label: compiling + steps_left * step for label, (compiling, step) in tried.items()}
    winner = min(totals, key=totals.__getitem__)
    described = "; ".join(
        f"{label} ({ways[label].describe()}) {tried[label][0]:.1f} s compiling + {tried[label][1]:.4f} s a step = "
        f"{totals[label]:.1f} s"
        for label in ways
    )
    report = f"{winner} over {steps_left} steps: {described}; {choice.describe()}"
    return CompileVerdict(ways[winner], report, tried)


def _tried(
    module: nn.Module,
    batch: Any,
    knobs: Knobs,
    device: torch.device,
    loss_fn: LossFn | None,
    optimizer: OptimizerSource | None,
    blocks: Any,
    steps: int,
    limit_bytes: int,
) -> tuple[float, float]:
    """(compile seconds, the fastest step's seconds) of ``knobs`` tried on ``device``; an OOM, or a measured peak
    over ``limit_bytes`` (off CUDA a compiled step's peak is not measured: 0), is an endless step."""
    trial = Trial(module, batch, knobs, device, loss_fn, optimizer, blocks)
    try:
        peak, step = trial.run(steps)
        return trial.compile_seconds, step if peak <= limit_bytes else float("inf")
    except Exception as error:
        if not is_oom_error(error):
            raise
        return 0.0, float("inf")
    finally:
        trial.release()
