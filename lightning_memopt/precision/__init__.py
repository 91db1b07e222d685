"""Mixed precision that adapts: ``"auto"`` per device, schedules, a fail-safe, fp32 islands.

The functional layer under :class:`~lightning_memopt.callbacks.PrecisionSwitch`.
"""

from lightning_memopt.precision.islands import (
    apply_fp32_islands,
    is_fp32_island,
    remove_fp32_islands,
)
from lightning_memopt.precision.plugin import SwitchablePrecision
from lightning_memopt.precision.resolve import (
    auto_precision,
    mantissa_bits,
    normalise_precision,
    step_down,
    supports_bf16,
)
from lightning_memopt.precision.schedule import INTERVALS, PrecisionSchedule, PrecisionScheduleSpec, ScheduleInterval
from lightning_memopt.vocabulary import PRECISION_FALLBACK, PRECISIONS, PrecisionName, PrecisionSetting

__all__ = [
    "INTERVALS",
    "PRECISIONS",
    "PRECISION_FALLBACK",
    "PrecisionName",
    "PrecisionSchedule",
    "PrecisionScheduleSpec",
    "PrecisionSetting",
    "ScheduleInterval",
    "SwitchablePrecision",
    "apply_fp32_islands",
    "auto_precision",
    "is_fp32_island",
    "mantissa_bits",
    "normalise_precision",
    "remove_fp32_islands",
    "step_down",
    "supports_bf16",
]
