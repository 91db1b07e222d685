"""Say what recovery did, once, on rank zero: through Lightning's rank-zero logging, as a Lightning run shows it.

Lightning is imported at the first message, not with the package: the functional core runs without a
Trainer, and importing ``lightning.fabric`` is what sets the rank these functions read.
"""

from __future__ import annotations


def info(message: str) -> None:
    """Log ``message`` at INFO on rank zero (``lightning.fabric.utilities.rank_zero.rank_zero_info``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    rank_zero_info(message)


def warn(message: str) -> None:
    """Warn with ``message`` on rank zero (``lightning.fabric.utilities.rank_zero.rank_zero_warn``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(message, stacklevel=5)  # (the warning's place: the line that called this function)
