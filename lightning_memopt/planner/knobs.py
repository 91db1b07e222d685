"""Knobs: one configuration of the settings that change a step's memory and speed but not its result."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_memopt.models.structure import ATTENTION_IMPLS
from lightning_memopt.planner.sharding import Sharding

CHECKPOINT_MODES = ("none", "selective", "full", "offload")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class Knobs:
    """Precision, attention kernel, activation checkpointing, micro-batch size, FSDP sharding and CPU offload.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        attn_impl: ``"sdpa"`` (fused attention) or ``"math"`` (materialised), or ``None`` to leave
            the model's attention as built.
        checkpoint: ``"none"``, ``"selective"``, ``"full"`` or ``"offload"`` on the model's blocks
            (declared, else discovered, unless the plan was given other ``blocks``).
        every_n: checkpoint every n-th of each run of sibling blocks (1: all of them).
        micro_batch_size: split each batch into micro-batches of this size, gradients accumulated
            into the same optimizer step; ``None``: whole batches.
        shards: FSDP (``fsdp_memopt``) over this many GPUs: each holds 1/``shards`` of the
            parameters, gradients and optimizer state (1: no sharding).
        cpu_offload: keep the (sharded) parameters, gradients and optimizer state in host memory
            and run the optimizer step there (``fsdp_memopt`` with ``cpu_offload``, at any ``shards``).

    Raises:
        ValueError: for a value outside the choices above.

    Example::

        >>> knobs = Knobs("bf16-mixed", checkpoint="full", every_n=2)
        >>> knobs.describe()
        'bf16-mixed, full every 2'
        >>> knobs.checkpoint_policy()
        {'modules': 'auto', 'every_n': 2, 'mode': 'full'}
        >>> Knobs("bf16-mixed", shards=4, cpu_offload=True).describe()
        'bf16-mixed, FSDP ×4, CPU offload'
    """

    precision: str = "32-true"
    attn_impl: str | None = None
    checkpoint: str = "none"
    every_n: int = 1
    micro_batch_size: int | None = None
    shards: int = 1
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        if self.attn_impl is not None:
            _check_choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)
        _check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        for name in ("every_n", "shards"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive int")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"`cpu_offload`={self.cpu_offload!r} must be True or False")
        size = self.micro_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"`micro_batch_size`={size!r} must be a positive int or None")

    def checkpoint_policy(self, blocks: Any = "auto") -> dict[str, Any] | None:
        """The :func:`~lightning_memopt.checkpointing.apply_activation_checkpointing` policy on ``blocks``, or ``None``.

        ``blocks``: ``"auto"`` (the model's declared, else discovered, blocks) or module classes,
        dotted paths and name globs.
        """
        if self.checkpoint == "none":
            return None
        return {"modules": blocks, "every_n": self.every_n if self.every_n > 1 else None, "mode": self.checkpoint}

    def describe(self) -> str:
        """A short, readable form: ``"bf16-mixed, sdpa, full every 2, micro-batch 32, FSDP ×4, CPU offload"``."""
        parts = [self.precision]
        if self.attn_impl is not None:
            parts.append(self.attn_impl)
        if self.checkpoint != "none":
            parts.append(self.checkpoint + (f" every {self.every_n}" if self.every_n > 1 else ""))
        if self.micro_batch_size is not None:
            parts.append(f"micro-batch {self.micro_batch_size}")
        sharding = self.sharding.describe()
        return ", ".join([*parts, sharding] if sharding else parts)

    @property
    def sharding(self) -> Sharding:
        """How these knobs shard the step (FSDP degree and CPU offload)."""
        return Sharding(self.shards, self.cpu_offload)

    def as_dict(self) -> dict[str, Any]:
        """The knobs as plain values (the ``knobs`` argument of :class:`~lightning_memopt.MemoryBudget`)."""
        return asdict(self)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown `{name}`={value!r}; valid choices: {', '.join(choices)}")
