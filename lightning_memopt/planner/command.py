"""The ``memopt-train`` command line that runs a plan's knobs: plain strings, no Hydra (callbacks quote it too)."""

from __future__ import annotations

import shlex
from typing import Any

from lightning_memopt.planner.knobs import Knobs


def train_command(overrides: list[str], knobs: Knobs) -> str:
    """The ``memopt-train`` command line that runs ``knobs`` on the config given by ``overrides``.

    One override, ``knobs={…}``, holds the plan: its precision and the knobs that differ from their defaults
    (:class:`~lightning_memopt.MemoryBudget` applies them). A plan that shards or offloads runs under
    ``strategy=fsdp_memopt`` on ``shards`` devices, with ``bf16-mixed`` on the Trainer (so that the units are
    gathered in bf16, as planned).

    Example::

        >>> train_command(["model=r100", "gpu=a100_40gb"], Knobs("bf16-mixed", checkpoint="full"))
        "memopt-train model=r100 'knobs={precision:bf16-mixed,checkpoint:full}'"
        >>> command = train_command(["model=sapiens_2b", "gpu=rtx3090_24gb"], Knobs("bf16-mixed", cpu_offload=True))
        >>> command.split()[1:5]
        ['model=sapiens_2b', 'strategy=fsdp_memopt', 'trainer.devices=1', 'trainer.strategy.cpu_offload=true']
    """
    kept = [o for o in overrides if o.split("=")[0].lstrip("+~") not in ("gpu", "budget", "devices", "safety_margin")]
    kept = [o for o in kept if not o.startswith(("plan.", "precision=", "memopt=", "knobs="))]
    extra = []
    if knobs.sharding.active:
        kept = [o for o in kept if not o.startswith(("strategy=", "trainer.devices=", "trainer.strategy."))]
        extra = ["strategy=fsdp_memopt", f"trainer.devices={knobs.shards}"]
        extra += ["trainer.strategy.cpu_offload=true"] if knobs.cpu_offload else []
        extra += ["precision=bf16_mixed"] if knobs.precision == "bf16-mixed" else []  # (16-mixed: PrecisionSwitch)
    return " ".join(["memopt-train", *kept, *extra, shlex.quote(knobs_override(knobs))])


def knobs_override(knobs: Knobs) -> str:
    """The one Hydra override that gives ``memopt-train`` these knobs: the precision and every knob off its default.

    Example::

        >>> knobs_override(Knobs("32-true", micro_batch_size=8, checkpoint_blocks=[("blocks.0", "full")],
        ...                      checkpoint="per_block"))
        'knobs={precision:32-true,checkpoint:per_block,micro_batch_size:8,checkpoint_blocks:[[blocks.0,full]]}'
    """
    defaults = Knobs().as_dict()
    values = {key: value for key, value in knobs.as_dict().items() if key == "precision" or value != defaults[key]}
    return "knobs={" + ",".join(f"{key}:{_hydra_value(value)}" for key, value in values.items()) + "}"


def _hydra_value(value: Any) -> str:
    """A knob's value as a Hydra override writes it (block modes as a list of pairs)."""
    if isinstance(value, tuple):
        return "[" + ",".join(f"[{name},{mode}]" for name, mode in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
