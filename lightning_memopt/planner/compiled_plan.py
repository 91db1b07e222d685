"""A compiled step's plan: the largest ``activation_memory_budget`` whose predicted peak fits a memory limit.

``torch.compile`` recomputes what its min-cut partitioner does not save, and saves less as the budget falls (1.0:
what the runtime-optimal cut saves; 0.0: nothing it can recompute). The fastest compiled step that fits is the one
that saves the most within the limit: :func:`plan_compiled` predicts each budget's peak in fake mode
(:func:`~lightning_memopt.memory.compiled_step.predict_compiled_step`), from the largest down, and stops at the first
that fits. Apply the choice with ``torch._functorch.config.patch(activation_memory_budget=plan.budget)`` around the
first compiled step (compilation is lazy), no activation checkpointing of ours beside it.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_memopt.arguments import check_int
from lightning_memopt.memory.compiled_step import CompiledStepPeak, predict_compiled_step
from lightning_memopt.memory.oom import is_oom_error
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
    """Compiled or eager, and why: both timed on the device (the fastest step of each, and the compiled one's first
    step less that: compiling), compiling counted against the steps left to run. Not tried: the times are NaN."""

    knobs: Knobs
    report: str
    eager_seconds: float = math.nan
    compiled_seconds: float = math.nan
    compile_seconds: float = math.nan


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
    """The plan's choice, or the same knobs compiled (no checkpointing of ours: the compiler recomputes) at the largest
    ``activation_memory_budget`` predicted to fit beside the step's weights, optimizer state and batch, whichever
    ends the ``steps_left`` steps sooner: both are tried on ``device`` (the compiled one compiles there, timed), and
    the compiled one wins only if its compile time plus its steps beat the eager steps. Nothing of the run changes.
    """
    eager = plan.chosen
    if eager is None:
        return CompileVerdict(Knobs(), "torch.compile not weighed: nothing to compare with (no plan fits)")
    state = sum(eager.estimate.phases.get("setup", {}).values())
    piece = next(micro_batches(batch, eager.knobs.micro_batch_size))[0]

    def loss(model: nn.Module, micro_batch: Any) -> torch.Tensor:
        return training_step_fn(model, loss_fn)(micro_batch)

    choice = plan_compiled(module, piece, loss, max(1, plan.limit_bytes - state), precision=eager.knobs.precision)
    if not choice.fits:
        return CompileVerdict(
            eager.knobs, f"eager: no compiled step fits ({choice.describe()} beside {state / MIB:.1f} MiB of state)"
        )
    compiled = replace(eager.knobs, checkpoint="none", every_n=1, checkpoint_blocks=(), compile_budget=choice.budget)
    seconds: dict[str, float] = {}
    compile_seconds = 0.0
    for name, knobs in (("eager", eager.knobs), ("compiled", compiled)):
        trial = Trial(module, batch, knobs, device, loss_fn, optimizer, blocks)
        try:
            _, seconds[name] = trial.run(trial_steps)
            compile_seconds = max(compile_seconds, trial.compile_seconds)
        except Exception as error:
            if not is_oom_error(error):
                raise
            seconds[name] = float("inf")
        finally:
            trial.release()
    eager_total = steps_left * seconds["eager"]
    compiled_total = compile_seconds + steps_left * seconds["compiled"]
    winner = compiled if compiled_total < eager_total else eager.knobs
    report = (
        f"{'compiled' if winner is compiled else 'eager'} over {steps_left} steps: compiled {compile_seconds:.1f} s "
        f"compiling + {seconds['compiled']:.4f} s a step = {compiled_total:.1f} s, eager ({eager.knobs.describe()}) "
        f"{seconds['eager']:.4f} s a step = {eager_total:.1f} s; {choice.describe()}"
    )
    return CompileVerdict(winner, report, seconds["eager"], seconds["compiled"], compile_seconds)
