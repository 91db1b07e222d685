"""The smallest micro-batch a model takes: what inspection sees (batch norm in training), and what errors taught."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from lightning_memopt.private_api import is_batch_norm

MinSize = tuple[int | None, str | None]  # a smallest size (None: none known) and why


def check_min_size(min_size: int) -> None:
    """Raise ``ValueError`` unless ``min_size`` is an int ≥ 1."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"`min_size`={min_size!r} must be an int ≥ 1 (1: any size; 2: batch norm in training)")


def batch_norms(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of ``module`` (what :func:`min_micro_batch_size` looks at)."""
    return [m for m in module.modules() if is_batch_norm(m)]


def min_micro_batch_size(module: nn.Module, norms: list[nn.Module] | None = None) -> tuple[int, str | None]:
    """The smallest micro-batch ``module`` takes as it is now, and why (``None`` when any size does).

    A batch-norm layer that normalises by the batch's statistics (in training, or without running
    statistics) needs at least 2 samples for an ``[N, C]`` input: one sample has no variance.
    ``norms``: the module's :func:`batch_norms`, when already known (their modes are read now).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> min_micro_batch_size(model)
        (2, 'its BatchNorm1d layers need at least 2 samples in training')
        >>> min_micro_batch_size(model.eval())
        (1, None)
    """
    layers = sorted(
        {
            type(m).__name__
            for m in (batch_norms(module) if norms is None else norms)
            if m.training or (m.running_mean is None and m.running_var is None)
        }
    )
    if not layers:
        return 1, None
    return 2, f"its {', '.join(layers)} layers need at least 2 samples in training"


def largest_min_size(seen: tuple[int, str | None], *learned: MinSize) -> tuple[int, str | None]:
    """The largest of the minimum inspection ``seen`` and those errors taught (``None``: none); the first of equals.

    Example::

        >>> largest_min_size((2, "batch norm"), (None, None), (3, "a piece of 2 failed"), (3, "again"))
        (3, 'a piece of 2 failed')
    """
    size, reason = seen
    for least, why in learned:
        if least is not None and least > size:
            size, reason = least, why
    return size, reason


class _Runner(Protocol):  # what :func:`update_min_size` reads and sets of a MicroBatchRunner
    module: nn.Module
    min_size: int
    min_size_reason: str | None
    learned_min_size: int | None
    learned_min_size_reason: str | None


def update_min_size(runner: _Runner, norms: list[nn.Module] | None, *learned: MinSize) -> tuple[int, str | None]:
    """Set ``runner``'s minimum to what its module takes as it is now, or more when an error taught more.

    Args:
        runner: a :class:`~lightning_memopt.accumulation.MicroBatchRunner`; what it learned counts.
        norms: its module's :func:`batch_norms`, when already listed (``None``: the module is walked).
        learned: other minimums errors taught, ``(size or None, why)``.

    Example::

        >>> from lightning_memopt.accumulation import MicroBatchRunner
        >>> runner = MicroBatchRunner(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
        >>> update_min_size(runner, None, (3, "a piece of 2 failed")), runner.min_size
        ((3, 'a piece of 2 failed'), 3)
    """
    seen = min_micro_batch_size(runner.module, norms)
    size, reason = largest_min_size(seen, (runner.learned_min_size, runner.learned_min_size_reason), *learned)
    runner.min_size, runner.min_size_reason = size, reason
    return size, reason
