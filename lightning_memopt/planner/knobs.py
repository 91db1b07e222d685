"""Knobs: one configuration of the settings that change a step's memory and speed but not its result, and the
``memopt-train`` command line that runs them (:func:`train_command`; plain strings, no Hydra).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from typing_extensions import TypedDict

from lightning_memopt.arguments import check_bool, check_int, check_optional_float, check_optional_int
from lightning_memopt.planner.sharding import Sharding
from lightning_memopt.vocabulary import (
    ATTENTION_IMPLS,
    CHECKPOINT_KNOBS,
    POLICY_MODES,
    PRECISIONS,
    AttentionImpl,
    CheckpointKnob,
    PrecisionName,
)

PER_BLOCK = "per_block"  # the `checkpoint` knob when each block has a mode of its own (`checkpoint_blocks`)


class KnobsMapping(TypedDict, total=False):
    """:class:`Knobs` as a mapping of its fields, as ``memopt-plan`` prints them (keys == :data:`FIELDS`)."""

    precision: PrecisionName
    attn_impl: AttentionImpl | None
    checkpoint: CheckpointKnob
    every_n: int
    micro_batch_size: int | None
    shards: int
    cpu_offload: bool
    checkpoint_blocks: list[list[str]]
    compile_budget: float | None


@dataclass(frozen=True)
class Knobs:
    """Precision, attention kernel, activation checkpointing, micro-batch size, FSDP sharding and CPU offload.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        attn_impl: ``"sdpa"`` (fused attention) or ``"math"`` (materialised), or ``None`` to leave
            the model's attention as built.
        checkpoint: ``"none"``, ``"selective"``, ``"full"`` or ``"offload"`` on the model's blocks
            (declared, else discovered, unless the plan was given other ``blocks``), or ``"per_block"``:
            the modes of ``checkpoint_blocks``.
        every_n: checkpoint every n-th of each run of sibling blocks (1: all of them).
        checkpoint_blocks: with ``checkpoint="per_block"``, ``(module name, mode)`` pairs (or a mapping):
            each named block checkpointed in its mode (``"full"``, ``"selective"``, ``"offload"``, ``"lean"``), the
            others kept, as the planner's checkpointing frontier picks them.
        micro_batch_size: split each batch into micro-batches of this size, gradients accumulated
            into the same optimizer step; ``None``: whole batches.
        shards: FSDP (``fsdp_memopt``) over this many GPUs: each holds 1/``shards`` of the
            parameters, gradients and optimizer state (1: no sharding).
        cpu_offload: keep the (sharded) parameters, gradients and optimizer state in host memory
            and run the optimizer step there (``fsdp_memopt`` with ``cpu_offload``, at any ``shards``).
        compile_budget: run the model ``torch.compile``d, its min-cut partitioner saving this fraction in [0, 1] of
            what it could (``activation_memory_budget``; :mod:`~lightning_memopt.planner.compiled_plan`); ``None``:
            eager.

    Raises:
        ValueError: for a value outside the choices above (``every_n``, ``shards`` and
            ``micro_batch_size`` at least 1; ``cpu_offload`` a bool or a word such as ``"off"``).
        TypeError: a count that is no integer (``"two"``, ``True``).

    Example::

        >>> knobs = Knobs("bf16-mixed", checkpoint="full", every_n=2)
        >>> knobs.describe()
        'bf16-mixed, full every 2'
        >>> knobs.checkpoint_policy()
        {'modules': 'auto', 'every_n': 2, 'mode': 'full'}
        >>> Knobs("bf16-mixed", shards=4, cpu_offload=True).describe()
        'bf16-mixed, FSDP ×4, CPU offload'
        >>> Knobs(checkpoint="per_block", checkpoint_blocks={"blocks.0": "full", "blocks.1": "selective"}).describe()
        '32-true, per block: full ×1, selective ×1'
        >>> Knobs("bf16-mixed", compile_budget=0.6).describe()
        'bf16-mixed, compiled at activation budget 0.6'
    """

    precision: str = "32-true"
    attn_impl: str | None = None
    checkpoint: str = "none"
    every_n: int = 1
    micro_batch_size: int | None = None
    shards: int = 1
    cpu_offload: bool = False
    checkpoint_blocks: tuple[tuple[str, str], ...] = ()
    compile_budget: float | None = None

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        if self.attn_impl is not None:
            _check_choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)
        _check_choice("checkpoint", self.checkpoint, (*CHECKPOINT_KNOBS, PER_BLOCK))
        object.__setattr__(self, "checkpoint_blocks", _block_modes(self.checkpoint_blocks))
        if (self.checkpoint == PER_BLOCK) != bool(self.checkpoint_blocks):
            raise ValueError(
                f"`checkpoint_blocks` ({len(self.checkpoint_blocks)} given) go with `checkpoint`={PER_BLOCK!r} and "
                f"only with it (got `checkpoint`={self.checkpoint!r}): give both or neither"
            )
        # values as Hydra gives them ("off", 2.0) in their proper types, so equal knobs compare equal
        object.__setattr__(self, "every_n", check_int("every_n", self.every_n, minimum=1))
        object.__setattr__(self, "shards", check_int("shards", self.shards, minimum=1))
        object.__setattr__(self, "cpu_offload", check_bool("cpu_offload", self.cpu_offload))
        size = check_optional_int("micro_batch_size", self.micro_batch_size, minimum=1)
        object.__setattr__(self, "micro_batch_size", size)
        budget = check_optional_float("compile_budget", self.compile_budget, minimum=0.0, maximum=1.0)
        object.__setattr__(self, "compile_budget", budget)

    @classmethod
    def from_mapping(cls, values: Any, argument: str = "knobs") -> Knobs:
        """Knobs from a mapping of their fields (as ``memopt-plan`` prints them, or a Hydra config).

        Raises:
            TypeError: ``values`` is no mapping.
            ValueError: an unknown field, listing the fields, or a bad value.

        Example::

            >>> Knobs.from_mapping({"precision": "bf16-mixed", "cpu_offload": "off"}).describe()
            'bf16-mixed'
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"`{argument}` must be a mapping of {', '.join(FIELDS)}, got {values!r} ({type(values).__name__})"
            )
        unknown = [key for key in values if key not in FIELDS]
        if unknown:
            raise ValueError(f"Unknown `{argument}` fields {unknown}; valid fields: {', '.join(FIELDS)}")
        return cls(**values)

    def checkpoint_policy(self, blocks: Any = "auto") -> dict[str, Any] | None:
        """The :func:`~lightning_memopt.checkpointing.apply_activation_checkpointing` policy on ``blocks``, or ``None``.

        ``blocks``: ``"auto"`` (the model's declared, else discovered, blocks) or module classes,
        dotted paths and name globs.
        """
        if self.checkpoint == "none":
            return None
        if self.checkpoint == PER_BLOCK:
            return [{"modules": name, "mode": mode} for name, mode in self.checkpoint_blocks]
        return {"modules": blocks, "every_n": self.every_n if self.every_n > 1 else None, "mode": self.checkpoint}

    def with_block_modes(self, modes: Mapping[str, str], blocks: Iterable[str]) -> Knobs:
        """These knobs checkpointing ``modes`` (block name → mode): one mode on all of ``blocks`` is that mode.

        Example::

            >>> Knobs().with_block_modes({"a": "full", "b": "full"}, ["a", "b"]).checkpoint
            'full'
            >>> Knobs().with_block_modes({"a": "full"}, ["a", "b"]).checkpoint_blocks
            (('a', 'full'),)
        """
        one_mode = set(modes.values())
        uniform = set(modes) == set(blocks) and len(one_mode) == 1 and one_mode <= {*CHECKPOINT_KNOBS}
        if not modes or uniform:
            mode = next(iter(modes.values()), "none")
            return replace(self, checkpoint=mode, every_n=1, checkpoint_blocks=())
        return replace(self, checkpoint=PER_BLOCK, every_n=1, checkpoint_blocks=tuple(modes.items()))

    def describe(self) -> str:
        """A short, readable form: ``"bf16-mixed, sdpa, full every 2, micro-batch 32, FSDP ×4, CPU offload"``."""
        parts = [self.precision]
        if self.attn_impl is not None:
            parts.append(self.attn_impl)
        if self.checkpoint == PER_BLOCK:
            counts = Counter(mode for _, mode in self.checkpoint_blocks)
            parts.append("per block: " + ", ".join(f"{mode} ×{count}" for mode, count in counts.items()))
        elif self.checkpoint != "none":
            parts.append(self.checkpoint + (f" every {self.every_n}" if self.every_n > 1 else ""))
        if self.micro_batch_size is not None:
            parts.append(f"micro-batch {self.micro_batch_size}")
        if self.compile_budget is not None:
            parts.append(f"compiled at activation budget {self.compile_budget:g}")
        sharding = self.sharding.describe()
        return ", ".join([*parts, sharding] if sharding else parts)

    @property
    def sharding(self) -> Sharding:
        """How these knobs shard the step (FSDP degree and CPU offload)."""
        return Sharding(self.shards, self.cpu_offload)

    def as_dict(self) -> dict[str, Any]:
        """The knobs as plain values (the ``knobs`` argument of :class:`~lightning_memopt.MemoryBudget`)."""
        return asdict(self)


FIELDS = tuple(field.name for field in fields(Knobs))


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown `{name}`={value!r}; valid choices: {', '.join(choices)}")


def _block_modes(values: Any) -> tuple[tuple[str, str], ...]:
    """``checkpoint_blocks`` as ``(name, mode)`` pairs, from pairs (lists, as Hydra gives them) or a mapping."""
    pairs = list(values.items()) if isinstance(values, Mapping) else values
    if isinstance(pairs, str) or not isinstance(pairs, Iterable):
        raise ValueError(f"`checkpoint_blocks`={values!r} must be (module name, mode) pairs or a mapping of them")
    checked = []
    for pair in pairs:
        if isinstance(pair, str) or not isinstance(pair, Iterable) or len(pair := tuple(pair)) != 2:
            raise ValueError(f"`checkpoint_blocks` entry {pair!r} must be a (module name, mode) pair")
        name, mode = pair
        if not isinstance(name, str) or not name:
            raise ValueError(f"`checkpoint_blocks` entry {pair!r}: the module name must be a non-empty string")
        if mode not in POLICY_MODES:
            choices = ", ".join(POLICY_MODES)
            raise ValueError(f"`checkpoint_blocks` entry {pair!r}: unknown mode {mode!r}; valid choices: {choices}")
        checked.append((name, str(mode)))
    return tuple(checked)


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
    planned_here = ("gpu=", "budget=", "devices=", "safety_margin=", "plan.", "precision=", "memopt=", "knobs=")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(planned_here)]
    extra = []
    if knobs.sharding.active:
        sharding = ("strategy=", "trainer.devices=", "trainer.strategy.")
        kept = [o for o in kept if not o.lstrip("+~").startswith(sharding)]
        extra = ["strategy=fsdp_memopt", f"trainer.devices={knobs.shards}"]
        extra += ["trainer.strategy.cpu_offload=true"] if knobs.cpu_offload else []
        extra += ["precision=bf16_mixed"] if knobs.precision == "bf16-mixed" else []  # (16-mixed: PrecisionSwitch)
    return " ".join(["memopt-train", *map(shlex.quote, [*kept, *extra, knobs_override(knobs)])])


def knobs_override(knobs: Knobs) -> str:
    """The one Hydra override that gives ``memopt-train`` these knobs: the precision and every knob off its default.

    Example::

        >>> knobs_override(Knobs("32-true", micro_batch_size=8, checkpoint_blocks=[("blocks.0", "full"), ("1", "lean")],
        ...                      checkpoint="per_block"))
        'knobs={precision:32-true,checkpoint:per_block,micro_batch_size:8,checkpoint_blocks:[[blocks.0,full],["1",lean]]}'
    """
    defaults = Knobs().as_dict()
    values = {key: value for key, value in knobs.as_dict().items() if key == "precision" or value != defaults[key]}
    return "knobs={" + ",".join(f"{key}:{_hydra_value(value)}" for key, value in values.items()) + "}"


def _hydra_value(value: Any) -> str:
    """A knob's value as a Hydra override writes it (block modes as a list of pairs; a block name that Hydra would
    read as another type, ``0`` or ``true``, or that holds a character of its grammar, in double quotes)."""
    if isinstance(value, tuple):
        return "[" + ",".join(f"[{_hydra_string(name)},{mode}]" for name, mode in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _hydra_string(text: str) -> str:
    plain = re.fullmatch(r"[A-Za-z_*?][\w.*?-]*", text) and text.lower() not in ("true", "false", "null", "nan", "inf")
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
