"""What ``memopt-train`` returns to a Hydra sweeper: one metric the fit logged (``objective=<metric>``).

``objective=auto`` (the default) is the task's validation metric: the ``validation_objective`` a
LightningModule declares as ``(metric, "max" | "min")`` — ``val/acc`` for face recognition,
``val/mean_angle`` for surface normals, ``val/delta_avg`` for point tracking — and ``val/loss`` for a
module that declares none. ``objective=null`` returns nothing (a sweep that only writes rows).

Example::

    >>> import torch
    >>> objective_value(Objective("val/acc", "max", given=True), {"val/acc": torch.tensor(0.75)})
    0.75
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_memopt.arguments import InputError

AUTO = "auto"
# what a LightningModule that declares no `validation_objective` is judged by
DEFAULT_OBJECTIVE = ("val/loss", "min")
DIRECTIONS = ("max", "min")


@dataclass(frozen=True)
class Objective:
    """A metric to return, which way is better (``None``: not known), and whether the user named it."""

    metric: str
    direction: str | None
    given: bool

    def describe(self, value: float) -> str:
        """``val/acc = 0.7500 (higher is better)``."""
        if self.direction is None:
            return f"{self.metric} = {value:.4f}"
        better = "higher" if self.direction == "max" else "lower"
        return f"{self.metric} = {value:.4f} ({better} is better)"


def resolve_objective(objective: object, model: Any) -> Objective | None:
    """The :class:`Objective` that ``objective`` (a metric name, ``"auto"`` or ``None``) names for ``model``.

    Raises:
        TypeError: ``objective`` is not a string, or the model's ``validation_objective`` is not a
            ``(metric, "max" | "min")`` pair.

    Example::

        >>> resolve_objective("auto", object())
        Objective(metric='val/loss', direction='min', given=False)
        >>> resolve_objective("train/loss", object()).given
        True
    """
    if objective is None:
        return None
    if not isinstance(objective, str) or not objective:
        raise TypeError(
            f"`objective` must be a logged metric's name (e.g. 'val/loss'), 'auto' or null, got {objective!r}"
        )
    declared = getattr(model, "validation_objective", DEFAULT_OBJECTIVE)
    if (
        not isinstance(declared, tuple)
        or len(declared) != 2
        or not isinstance(declared[0], str)
        or declared[1] not in DIRECTIONS
    ):
        raise TypeError(
            f"`{type(model).__name__}.validation_objective` must be (metric, 'max' | 'min'), got {declared!r}"
        )
    if objective == AUTO:
        return Objective(declared[0], declared[1], given=False)
    direction = declared[1] if objective == declared[0] else DEFAULT_OBJECTIVE[1] if objective == "val/loss" else None
    return Objective(objective, direction, given=True)


# a sweeper's `direction` (Optuna: maximize / minimize) -> the objective direction it optimises
SWEEPER_DIRECTIONS = {"maximize": "max", "minimize": "min"}


def check_sweeper_direction(objective: Objective | None, direction: object) -> None:
    """Refuse a sweeper ``direction`` that optimises ``objective`` the wrong way (where both are known).

    Raises:
        ValueError: naming ``hydra.sweeper.direction``, its value and the one the objective needs.

    Example::

        >>> check_sweeper_direction(Objective("val/acc", "max", given=False), "maximize")
        >>> try:
        ...     check_sweeper_direction(Objective("val/loss", "min", given=True), "maximize")
        ... except ValueError as error:
        ...     print(str(error).split(": ")[-1])
        set hydra.sweeper.direction=minimize
    """
    if objective is None or objective.direction is None or not isinstance(direction, str):
        return  # a multi-objective list, an unknown direction, or no optimising sweeper
    wanted = SWEEPER_DIRECTIONS.get(direction.rsplit(".", 1)[-1].lower())
    if wanted is None or wanted == objective.direction:
        return
    better = "higher" if objective.direction == "max" else "lower"
    needed = "maximize" if objective.direction == "max" else "minimize"
    verb = "maximise" if wanted == "max" else "minimise"
    raise ValueError(
        f"`hydra.sweeper.direction`={direction!r} would {verb} `objective` {objective.metric}, where {better} is"
        f" better: set hydra.sweeper.direction={needed}"
    )


def objective_value(objective: Objective | None, metrics: Mapping[str, Any]) -> float | None:
    """The value of ``objective`` among the fit's ``metrics`` (``trainer.callback_metrics``).

    Returns ``None`` for no objective, and for an ``auto`` one the fit never logged (validation did
    not run): the caller says so.

    Raises:
        InputError: a metric named with ``objective=`` that the fit never logged; the message lists
            the metrics it did log.
    """
    if objective is None:
        return None
    value = metrics.get(objective.metric)
    if value is None:
        if not objective.given:
            return None
        logged = ", ".join(sorted(metrics)) or "none"
        raise InputError(
            f"`objective`={objective.metric!r} was never logged by the fit; the metrics it logged: {logged}"
        )
    return float(value)
