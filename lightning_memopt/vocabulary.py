"""The project's vocabulary: precisions, checkpoint modes, attention kernels and units, declared once; and the
forms it prints them in (:func:`format_bytes`, :func:`aligned_table`).

Every layer imports its choices from here, so an argument check, a planner knob and a profile
agree on what a precision or a checkpoint mode is. Each runtime tuple has its ``Literal`` beside it
(for type checkers and LightningCLI); ``tests/test_public_signatures.py`` checks that they match.
This module imports nothing but ``typing``, so the command-line apps can read it before torch.

Example::

    >>> from lightning_memopt.vocabulary import CHECKPOINT_KNOBS, PRECISIONS, format_bytes
    >>> PRECISIONS, CHECKPOINT_KNOBS[0], format_bytes(3 * 2**29)
    (('32-true', 'bf16-mixed', '16-mixed'), 'none', '1.50 GiB')
"""

from __future__ import annotations

from typing import Literal

# ---------------------------------------------------------------- precisions
# what PrecisionSwitch moves between and the planner chooses from: all keep fp32 weights, so a switch needs no
# conversion
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed"]  # == PRECISIONS
# Lightning's legacy spellings
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
PrecisionAlias = Literal["32", "16", "bf16"]  # == tuple(PRECISION_ALIASES)
# what a precision argument takes: "auto" (chosen for the device), a name, an alias (32 and 16 as integers too)
PrecisionSetting = Literal["auto", PrecisionName, PrecisionAlias] | Literal[32, 16]
# weights stored in half precision: profile_step measures them, a Trainer runs them, nothing switches to them
HALF_WEIGHT_PRECISIONS = ("bf16-true", "16-true")
PROFILE_PRECISIONS = (*PRECISIONS, *HALF_WEIGHT_PRECISIONS)
# precisions that store the weights themselves in another type: set on the Trainer, never switched
WEIGHT_PRECISIONS = (*HALF_WEIGHT_PRECISIONS, "64-true", "64", "transformer-engine", "transformer-engine-float16")
# PrecisionSwitch's fail-safe steps down this order, left to right, skipping what the device cannot run
PRECISION_FALLBACK = ("16-mixed", "bf16-mixed", "32-true")

# ---------------------------------------------------------------- activation checkpointing
# how a checkpointed block keeps its activations: recomputed whole, recomputed but for the costly ops, on the host
CHECKPOINT_MODES = ("full", "selective", "offload")
CheckpointMode = Literal["full", "selective", "offload"]  # == CHECKPOINT_MODES
# full checkpointing by a block's own memory-lean recomputation (``checkpointed_forward``), plain full where it has none
LEAN = "lean"
POLICY_MODES = (*CHECKPOINT_MODES, LEAN)  # the modes a checkpointing policy names
PolicyMode = Literal["full", "selective", "offload", "lean"]  # == POLICY_MODES
NO_CHECKPOINT = "none"
# the planner's checkpoint knob: none, or a mode; from the cheapest to the most saving
CHECKPOINT_KNOBS = (NO_CHECKPOINT, "selective", "full", "offload")
CheckpointKnob = Literal["none", "selective", "full", "offload"]  # == CHECKPOINT_KNOBS

# ---------------------------------------------------------------- attention kernels
# fused scaled_dot_product_attention, or the materialised score matrix
ATTENTION_IMPLS = ("sdpa", "math")
AttentionImpl = Literal["sdpa", "math"]  # == ATTENTION_IMPLS

# ---------------------------------------------------------------- units
MIB = 2**20
GIB = 2**30
GB = 1e9  # the decimal gigabyte of the ``*_gb`` metric names (as nvidia-smi and Lightning's own monitor)


def format_bytes(nbytes: float, digits: int = 2, gib_from: float = GIB) -> str:
    """``nbytes`` in GiB from ``gib_from`` bytes on, in MiB below, with ``digits`` decimals.

    Example::

        >>> format_bytes(2**30), format_bytes(3 * 2**20), format_bytes(2**28, digits=3, gib_from=2**27)
        ('1.00 GiB', '3.00 MiB', '0.250 GiB')
    """
    if nbytes >= gib_from:
        return f"{nbytes / GIB:.{digits}f} GiB"
    return f"{nbytes / MIB:.{digits}f} MiB"


def aligned_table(header: list[str], body: list[list[str]], left: frozenset[int] = frozenset()) -> list[str]:
    """``header`` and ``body`` as aligned lines, two spaces between columns: the columns in ``left`` flush left,
    the others (numbers) flush right.

    Example::

        >>> aligned_table(["name", "MiB"], [["a", "1.50"], ["long", "12.00"]], left=frozenset({0}))
        ['name    MiB', 'a      1.50', 'long  12.00']
    """
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in [header, *body]
    ]
