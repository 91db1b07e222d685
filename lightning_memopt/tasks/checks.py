"""Argument checks of the task modules: pretrained files, option mappings, optimiser, schedule and loss settings.

Each returns the value in its proper type or raises naming the argument, the bad value and what
is valid (``TypeError`` for a value of the wrong kind, ``ValueError`` for one out of range,
``FileNotFoundError`` for a missing file), before anything is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_memopt.arguments import (
    check_bool,
    check_file,
    check_float,
    check_fraction,
    check_int,
    check_optional_int,
    check_path,
)
from lightning_memopt.losses.topology import VARIANTS
from lightning_memopt.tasks.common import check_schedule


def check_pretrained(
    pretrained: Any, pretrained_backbone: Any, weights_only: Any
) -> tuple[str | None, str | None, bool]:
    """``(pretrained, pretrained_backbone, pretrained_weights_only)``: existing files (or ``None``) and a bool.

    Raises:
        TypeError: a path that is no string.
        FileNotFoundError: no file there.
        IsADirectoryError: a folder where the checkpoint file is expected.
        ValueError: ``pretrained_weights_only`` neither a bool nor a word such as ``"on"`` / ``"off"``.

    Example::

        >>> check_pretrained(None, None, "no")
        (None, None, False)
    """
    whole = _checkpoint_file("pretrained", pretrained)
    backbone = _checkpoint_file("pretrained_backbone", pretrained_backbone)
    return whole, backbone, check_bool("pretrained_weights_only", weights_only)


def check_network(
    backbone: Any, backbone_options: Any, pretrained: Any, pretrained_backbone: Any, weights_only: Any
) -> tuple[str, dict[str, Any], str | None, str | None, bool]:
    """``(backbone, backbone_options, pretrained, pretrained_backbone, pretrained_weights_only)``: what every task
    builds its network from (see :func:`check_backbone`, :func:`check_options`, :func:`check_pretrained`).

    Example::

        >>> check_network("r18", None, None, None, "on")
        ('r18', {}, None, None, True)
    """
    backbone = check_backbone(backbone)
    options = check_options("backbone_options", backbone_options)
    return (backbone, options, *check_pretrained(pretrained, pretrained_backbone, weights_only))


def _checkpoint_file(name: str, value: Any) -> str | None:
    if value is None:
        return None
    path = check_path(name, value)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist (`{name}`)")
    return check_file(name, path)


def check_backbone(backbone: Any) -> str:
    """``backbone`` if it is a string (whether it names a preset, :func:`~lightning_memopt.models.create_model` checks).

    Raises:
        TypeError: not a string.

    Example::

        >>> check_backbone("r18")
        'r18'
    """
    if not isinstance(backbone, str):
        raise TypeError(
            f"`backbone` must be a preset name (lightning_memopt.models.list_models()), got {backbone!r} "
            f"({type(backbone).__name__})"
        )
    return backbone


def check_options(name: str, value: Any) -> dict[str, Any]:
    """``value`` (keyword options for a part the task builds) as a dict; ``None`` is empty.

    Raises:
        TypeError: not a mapping.

    Example::

        >>> check_options("backbone_options", None), check_options("backbone_options", {"input_size": 32})
        ({}, {'input_size': 32})
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"`{name}` must be a mapping of keyword options or None, got {value!r} ({type(value).__name__})"
        )
    return dict(value)


def check_betas(betas: Any) -> tuple[float, float]:
    """AdamW's ``betas``: two numbers in [0, 1).

    Raises:
        TypeError: not two numbers.
        ValueError: a beta outside [0, 1).

    Example::

        >>> check_betas([0.9, 0.999])
        (0.9, 0.999)
    """
    if isinstance(betas, str) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"`betas` must be two numbers in [0, 1), e.g. [0.9, 0.999], got {betas!r}")
    first, second = (check_fraction("betas", beta, open_maximum=True) for beta in betas)
    return first, second


def check_optimisation(
    lr: Any, weight_decay: Any, warmup_steps: Any, schedule: Any, power: Any
) -> tuple[float, float, int, str, float]:
    """``(lr, weight_decay, warmup_steps, schedule, power)``: lr > 0, weight decay ≥ 0, warm-up ≥ 0 steps,
    a known schedule and a decay exponent > 0.

    Raises:
        TypeError: a value that is no number (``lr="abc"``, ``warmup_steps=True``).
        ValueError: a value out of range, or an unknown schedule (listing the schedules).

    Example::

        >>> check_optimisation(0.1, 0, 100.0, "cosine", 2)
        (0.1, 0.0, 100, 'cosine', 2.0)
    """
    lr = check_float("lr", lr, minimum=0, open_minimum=True)
    weight_decay = check_float("weight_decay", weight_decay, minimum=0)
    warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
    schedule = check_schedule(schedule)
    power = check_float("power", power, minimum=0, open_minimum=True)
    return lr, weight_decay, warmup_steps, schedule, power


def check_topology_options(
    topo_weight: Any, variant: Any, topo_input_size: Any, em_iterations: Any
) -> tuple[float, int | None, int]:
    """``(topo_weight, topo_input_size, em_iterations)`` of the face task's topological loss, ``topo_variant`` known.

    Raises:
        ValueError: an unknown variant, a negative weight, an input size or EM iteration count below 1.
        TypeError: a number that is no number.

    Example::

        >>> check_topology_options(0.1, "diagram", None, 10.0)
        (0.1, None, 10)
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"Unknown `topo_variant`={variant!r}; valid choices: {', '.join(VARIANTS)}")
    topo_weight = check_float("topo_weight", topo_weight, minimum=0)  # 0 leaves the topological loss out
    topo_input_size = check_optional_int("topo_input_size", topo_input_size, minimum=1)  # None: the full images
    return topo_weight, topo_input_size, check_int("em_iterations", em_iterations, minimum=1)
