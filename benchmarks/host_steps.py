"""What checks the planner's host costs (:mod:`lightning_memopt.planner.host`): PyTorch's own checkpointing as the
anchor, the held-out narrow models the fit never saw, and the ratios the planner prices a narrow step at.

The planner fits its host costs on :data:`~lightning_memopt.planner.host.NARROW_MODELS`; importing this module adds
:data:`HELD_OUT_MODELS` (an IResNet and an MLP-Mixer block) to the narrow models it can build, and :data:`WRAPPERS`
adds ``torch``: every block under ``torch.utils.checkpoint``. ``claims/host_overhead.py``, ``gpu_truth/host.py`` and
``calibration/cost_model_h200.py`` use them.

Example::

    >>> model, x = narrow_model("mixer", blocks=2)
    >>> len(model), tuple(model(x).shape)
    (2, (2, 8, 16))
    >>> narrow_region("cnn"), narrow_region("cnn", 4)
    ((16, 304), (4, 304))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_memopt.memory.work import KernelCounter
from lightning_memopt.planner import host
from lightning_memopt.planner.host import NARROW_BUILDERS, SELECTIVE_KEPT, host_step_seconds, narrow_model
from lightning_memopt.private_api import disable_current_modes


class TorchCheckpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` as PyTorch recommends it (non-reentrant, its defaults); ``options``
    go to ``checkpoint`` (a ``context_fn`` for selective recomputation, say).

    Args:
        block: the module to checkpoint.
        options: more keyword arguments of ``torch.utils.checkpoint.checkpoint``.
    """

    def __init__(self, block: nn.Module, **options: Any) -> None:
        super().__init__()
        self.block = block
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, **self.options)


# how each variant treats every block of a narrow model: the planner's, and torch.utils.checkpoint's (the anchor)
WRAPPERS: dict[str, host.Wrapper] = {
    "none": host.WRAPPERS["none"],
    "torch": lambda model: nn.Sequential(*(TorchCheckpointed(block) for block in model)),
    **{variant: wrap for variant, wrap in host.WRAPPERS.items() if variant != "none"},
}


class PreActBasicBlock(nn.Module):
    """Batch norm, 3×3 convolution, batch norm, PReLU, 3×3 convolution, batch norm, and a residual: an IResNet
    block.

    Args:
        width: the channels.
    """

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(3))
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, bias=False) for _ in range(2))
        self.prelu = nn.PReLU(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.prelu(self.norms[1](self.convs[0](self.norms[0](x))))
        return x + self.norms[2](self.convs[1](y))


class MixerBlock(nn.Module):
    """Token mixing across the sequence (transposed), then channel mixing, each pre-norm with a residual: an
    MLP-Mixer block.

    Args:
        tokens: the sequence's length.
        width: the channels.
    """

    def __init__(self, tokens: int = 8, width: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.token1, self.token2 = nn.Linear(tokens, 2 * tokens), nn.Linear(2 * tokens, tokens)
        self.channel1, self.channel2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token2(F.gelu(self.token1(self.norm1(x).transpose(1, 2))))
        x = x + mixed.transpose(1, 2)
        return x + self.channel2(F.gelu(self.channel1(self.norm2(x))))


HELD_OUT_MODELS = ("iresnet", "mixer")  # the host's costs are checked on these, which the fit never saw
NARROW_BUILDERS.update(iresnet=(PreActBasicBlock, 16, (2, 8, 8, 8)), mixer=(MixerBlock, 12, (2, 8, 16)))


def host_step_ratios(name: str, rounds: int = 10) -> dict[str, float]:
    """:func:`~lightning_memopt.planner.host.host_step_seconds` of every variant of :data:`WRAPPERS` over the step
    without checkpointing."""
    seconds = host_step_seconds(name, rounds, wrappers=WRAPPERS)
    return {variant: value / seconds["none"] for variant, value in seconds.items()}


def priced_host_ratios(
    name: str, kernel_seconds: float, region_seconds: Mapping[str, tuple[float, float]], group: int = 1
) -> dict[str, float]:
    """What the planner prices a step of the narrow model ``name`` at, each of our modes over none, on a host that
    spends ``kernel_seconds`` per kernel and ``region_seconds`` per wrapped call and per forward op in it (its
    :class:`~lightning_memopt.planner.hardware.Hardware`'s), its blocks wrapped ``group`` a call: every kernel of
    the step, recomputed ones included, and each wrapped call's Python work. Selective is priced keeping its
    expensive ops (``selective kept``).

    Example::

        >>> free = dict.fromkeys(("full", "selective", "offload"), (0.0, 0.0))
        >>> ratios = priced_host_ratios("cnn", 1e-5, free)
        >>> sorted(ratios), round(ratios["full"], 2)    # free Python: the recomputed forward kernels only
        (['full', 'none', 'offload', 'selective kept'], 1.2)
    """
    calls, ops = narrow_region(name, group)
    variants = {"none": "none", "full": "full", "offload": "offload", SELECTIVE_KEPT: "selective"}
    seconds = {}
    for variant, mode in variants.items():
        per_call, per_op = region_seconds[mode] if mode != "none" else (0.0, 0.0)
        kernels = host.step_kernels(name, None, host.in_groups(WRAPPERS[variant], group))
        seconds[variant] = kernels * kernel_seconds + calls * per_call + ops * per_op
    return {variant: value / seconds["none"] for variant, value in seconds.items()}


def narrow_region(name: str, group: int = 1) -> tuple[int, int]:
    """The narrow model ``name`` with its blocks wrapped ``group`` a call, as the planner counts its region:
    ``(calls, forward ops)``."""
    model, x = narrow_model(name)
    with disable_current_modes(), KernelCounter() as counter:
        model(x)
    return -(-len(model) // group), counter.ops
