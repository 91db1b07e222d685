"""Options that change the training result, measured so the user can weigh them: what each saves, and its caveat."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memopt.memory.profile import MemoryProfile
from lightning_memopt.planner.knobs import Knobs


@dataclass(frozen=True)
class ResultChangingOption:
    """A change to the model or data that saves memory but changes what is trained.

    Args:
        name: what changes, e.g. ``"traj_per_sample 768 → 384"``.
        caveat: what it costs in results, as reported.
        overrides: the ``memopt-train`` overrides that make the change.
        model: a factory for the changed model (``None``: the same model).
        batch: the changed training batch (``None``: the same batch).
    """

    name: str
    caveat: str
    overrides: tuple[str, ...]
    model: Callable[[], nn.Module] | None = None
    batch: Any = None


@dataclass(frozen=True)
class MeasuredOption:
    """An option with its predicted peak and what it saves against the same knobs without it (``against``: those
    knobs, described; ``reference_bytes``: their peak without the option)."""

    option: ResultChangingOption
    peak_bytes: int
    saving_bytes: int
    against: str = ""
    reference_bytes: int = 0


def measure_options(
    profile: Callable[..., MemoryProfile],
    knobs: Knobs,
    options: Sequence[ResultChangingOption],
    reference_bytes: int | None = None,
) -> list[MeasuredOption]:
    """Profile each option under ``knobs``; its saving is against ``reference_bytes`` (the same knobs without it).

    ``profile(knobs, model=..., batch=...)`` runs one fake-mode profile; the reference is profiled
    too when ``reference_bytes`` is not given.
    """
    reference = profile(knobs).peak_bytes if reference_bytes is None else reference_bytes
    measured = []
    for option in options:
        peak = profile(knobs, model=option.model, batch=option.batch).peak_bytes
        measured.append(MeasuredOption(option, peak, reference - peak, knobs.describe(), reference))
    return measured
