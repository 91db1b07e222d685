"""plan(): predict a training step's memory without a GPU and pick the fastest configuration that fits.

Example::

    >>> import torch
    >>> from lightning_memopt.models import create_model
    >>> from lightning_memopt.planner import gpu, plan, with_budget
    >>> result = plan(lambda: create_model("sapiens_tiny"), torch.randn(2, 3, 64, 48),
    ...               with_budget(gpu("h100_80gb"), 0.08), loss_fn=lambda m, x: m(x).square().mean(),
    ...               optimizer=lambda p: torch.optim.AdamW(p))
    >>> result.chosen.peak_bytes <= result.limit_bytes
    True
"""

from lightning_memopt.models.structure import set_attention
from lightning_memopt.planner.calibration import measure_cpu
from lightning_memopt.planner.checkpoint_budget import CheckpointChoice, plan_checkpointing
from lightning_memopt.planner.compiled_plan import CompiledPlan, plan_compiled
from lightning_memopt.planner.cost import StepCost, step_cost
from lightning_memopt.planner.hardware import GPUS, Hardware, cuda_hardware, gpu, with_budget
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.report import Candidate, MeasuredOption, Plan, PlanError, ResultChangingOption
from lightning_memopt.planner.search import plan

__all__ = [
    "GPUS",
    "Candidate",
    "CheckpointChoice",
    "CompiledPlan",
    "Hardware",
    "Knobs",
    "MeasuredOption",
    "Plan",
    "PlanError",
    "ResultChangingOption",
    "StepCost",
    "cuda_hardware",
    "gpu",
    "measure_cpu",
    "plan",
    "plan_checkpointing",
    "plan_compiled",
    "set_attention",
    "step_cost",
    "with_budget",
]
