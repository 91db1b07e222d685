"""Which precision to train in: Lightning's strings, ``"auto"`` for the device, and the fail-safe ladder."""

from __future__ import annotations

import math

import torch

from lightning_memopt.vocabulary import (
    PRECISION_ALIASES,
    PRECISION_FALLBACK,
    PRECISIONS,
    WEIGHT_PRECISIONS,
)

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def normalise_precision(value: object, argument: str = "precision") -> str:
    """A Lightning precision string for ``value`` (``16`` → ``"16-mixed"``, ``"bf16"`` → ``"bf16-mixed"``).

    Raises:
        ValueError: for anything but the precisions in :data:`PRECISIONS` and their aliases, naming
            ``argument`` and the valid choices.

    Example::

        >>> normalise_precision(16), normalise_precision("bf16"), normalise_precision("32-true")
        ('16-mixed', 'bf16-mixed', '32-true')
    """
    text = str(value)
    text = PRECISION_ALIASES.get(text, text)
    if text in PRECISIONS:
        return text
    if text in WEIGHT_PRECISIONS:
        raise ValueError(
            f"`{argument}`={value!r} converts the weights themselves and cannot be switched during a run; "
            f"set it with Trainer(precision=...), or choose one of: {', '.join(PRECISIONS)}"
        )
    raise ValueError(f"Unknown `{argument}`={value!r}; valid choices: {', '.join(PRECISIONS)} (or 'auto')")


def supports_bf16(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether ``device`` runs bf16 natively: every CPU, CUDA compute capability 8.0 (Ampere) and newer.

    ``capability`` overrides the one CUDA reports (for planning another GPU, and for tests).

    Example::

        >>> supports_bf16(torch.device("cpu")), supports_bf16(torch.device("cuda"), capability=(7, 0))
        (True, False)
    """
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return _capability(device, capability) >= (8, 0)


def auto_precision(device: torch.device, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """The precision ``"auto"`` picks on ``device``, and why.

    bf16-mixed where bf16 is native (CPU, CUDA ≥ 8.0); 16-mixed with a gradient scaler on CUDA
    7.x (V100, T4: tensor cores, but no bf16); 32-true on anything else.

    Example::

        >>> auto_precision(torch.device("cuda"), capability=(7, 0))
        ('16-mixed', 'CUDA compute capability 7.0 has fp16 tensor cores but no native bf16')
    """
    if device.type == "cpu":
        return "bf16-mixed", "the CPU runs bf16 autocast"
    if device.type == "cuda":
        major, minor = _capability(device, capability)
        if (major, minor) >= (8, 0):
            return "bf16-mixed", f"CUDA compute capability {major}.{minor} supports bf16"
        if major >= 7:
            return "16-mixed", f"CUDA compute capability {major}.{minor} has fp16 tensor cores but no native bf16"
        return "32-true", f"CUDA compute capability {major}.{minor} has no tensor cores for mixed precision"
    return "32-true", f"mixed precision is not set up for {device.type!r} devices"


def step_down(precision: str, device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """The next safer precision on the fail-safe ladder that ``device`` runs, or ``None`` from 32-true.

    Example::

        >>> step_down("16-mixed", torch.device("cuda"), capability=(7, 0)), step_down("32-true", torch.device("cpu"))
        ('32-true', None)
    """
    for candidate in PRECISION_FALLBACK[PRECISION_FALLBACK.index(precision) + 1 :]:
        if candidate != "bf16-mixed" or supports_bf16(device, capability):
            return candidate
    return None


def mantissa_bits(precision: str) -> int:
    """The compute dtype's explicit mantissa bits, the number logged as ``memopt/precision``: 23, 7 or 10.

    Example::

        >>> [mantissa_bits(p) for p in PRECISIONS]
        [23, 7, 10]
    """
    dtype = AUTOCAST_DTYPES.get(precision, torch.float32)
    return -round(math.log2(torch.finfo(dtype).eps))


def _capability(device: torch.device, capability: tuple[int, int] | None) -> tuple[int, int]:
    if capability is not None:
        return tuple(capability)  # type: ignore[return-value]
    return torch.cuda.get_device_capability(device)
