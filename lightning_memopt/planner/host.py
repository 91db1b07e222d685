"""The host's share of a step: what Python, autograd and dispatch cost per kernel, and what checkpointing adds.

A GPU runs a step's kernels while the host queues the next ones; when the host takes longer than the
device (small batches, narrow layers, many blocks wrapped), the host sets the step's time. That work
is the same on a CPU as beside a GPU, so it is measured here on narrow models with tiny tensors,
where the arithmetic is negligible: a residual CNN with batch norm and a pre-norm transformer, each
step timed without checkpointing, with each mode of ours on every block, and with PyTorch's own
``torch.utils.checkpoint`` (the anchor), interleaved round by round, the fastest round of each kept.
``selective`` is the mode as a model gets it: on tensors this small keeping the matmuls does not pay, so
after its first calls each block is recomputed in full (:mod:`~lightning_memopt.checkpointing.selective_payoff`);
``selective kept`` keeps them on every call: the cost of the mode itself, which the planner prices.

Example::

    >>> ratios = host_step_ratios("cnn", rounds=2)
    >>> sorted(ratios)
    ['full', 'none', 'offload', 'selective', 'selective kept', 'torch']
    >>> ratios["none"]
    1.0
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_memopt.checkpointing.wrap import checkpoint_modules
from lightning_memopt.memory.work import KernelCounter
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import CHECKPOINT_MODES

NARROW_MODELS = ("cnn", "transformer")


class Bottleneck(nn.Module):
    """1×1, 3×3 and 1×1 convolutions with batch norm and ReLU, and a residual: a ResNet block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(width, width, k, padding=k // 2, bias=False) for k in (1, 3, 1))
        self.norms = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
            y = norm(conv(y))
            y = F.relu(y + x if index == 2 else y)
        return y


class EncoderBlock(nn.Module):
    """Pre-norm attention and MLP with residuals: a ViT block."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def narrow_model(name: str, blocks: int | None = None) -> tuple[nn.Sequential, torch.Tensor]:
    """A narrow model of ``name`` (``"cnn"``: 16 bottlenecks; ``"transformer"``: 12 encoder blocks; or ``blocks``
    of them) and its input.

    Raises:
        ValueError: an unknown ``name``, listing :data:`NARROW_MODELS`.
    """
    if name == "cnn":
        return nn.Sequential(*(Bottleneck() for _ in range(blocks or 16))), torch.randn(2, 8, 8, 8)
    if name == "transformer":
        return nn.Sequential(*(EncoderBlock() for _ in range(blocks or 12))), torch.randn(2, 8, 16)
    raise ValueError(f"Unknown `name`={name!r}; valid choices: {', '.join(NARROW_MODELS)}")


class TorchCheckpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` as PyTorch recommends it (non-reentrant, its defaults); ``options``
    go to ``checkpoint`` (a ``context_fn`` for selective recomputation, say)."""

    def __init__(self, block: nn.Module, **options: Any) -> None:
        super().__init__()
        self.block = block
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, **self.options)


Wrapper = Callable[[nn.Sequential], nn.Module]


def _ours(mode: str) -> Wrapper:
    def wrap(model: nn.Sequential) -> nn.Module:
        checkpoint_modules(model, {"modules": [str(i) for i in range(len(model))], "mode": mode})
        return model

    return wrap


def _selective_kept(model: nn.Sequential) -> nn.Module:
    """Selective on every block, keeping the expensive ops even where that does not pay (as it does not on tiny
    tensors, where ``"selective"`` recomputes in full after its first calls): the cost of the mode itself."""
    wrapped = _ours("selective")(model)
    for block in wrapped:
        block.forward.state.selective.pays = True
    return wrapped


SELECTIVE_KEPT = "selective kept"
# how each variant treats every block of a narrow model
WRAPPERS: dict[str, Wrapper] = {
    "none": lambda model: model,
    "torch": lambda model: nn.Sequential(*(TorchCheckpointed(block) for block in model)),
    **{mode: _ours(mode) for mode in CHECKPOINT_MODES},
    SELECTIVE_KEPT: _selective_kept,
}


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def host_step_seconds(
    name: str,
    rounds: int = 10,
    steps: int = 5,
    blocks: int | None = None,
    wrappers: Mapping[str, Wrapper] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """The fastest host time of a training step of the narrow model ``name`` (of ``blocks`` blocks) under each
    variant of ``wrappers`` (default :data:`WRAPPERS`).

    Variants run interleaved, ``steps`` steps a round, after one warm-up round; one thread. Its tensors are
    the host's own: a tracker, fake mode or ``SimulatedDevice`` around the call sees none of them. On a
    ``device`` other than the CPU (a GPU: its tiny kernels leave the step to the host that queues them) each
    round waits for the device before its clock stops.
    """
    wrappers = WRAPPERS if wrappers is None else wrappers
    device = torch.device(device)
    with disable_current_modes():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            models = {variant: _built(name, blocks, wrap, device) for variant, wrap in wrappers.items()}
            fastest = dict.fromkeys(wrappers, float("inf"))
            for round_index in range(rounds + 1):
                for variant, (model, x) in models.items():
                    _synchronize(device)
                    started = time.perf_counter()
                    for _ in range(steps):
                        _step(model, x)
                    _synchronize(device)
                    if round_index:
                        fastest[variant] = min(fastest[variant], (time.perf_counter() - started) / steps)
        finally:
            torch.set_num_threads(threads)
    return fastest


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def host_step_ratios(name: str, rounds: int = 10) -> dict[str, float]:
    """:func:`host_step_seconds` over the step without checkpointing."""
    seconds = host_step_seconds(name, rounds)
    return {variant: value / seconds["none"] for variant, value in seconds.items()}


@dataclass(frozen=True)
class HostCosts:
    """The host's time per kernel, and what each checkpointing mode adds per forward kernel of a wrapped block
    beyond queuing the kernels it recomputes (as the planner prices a region: ``(per call, per kernel)``).

    Example::

        >>> costs = HostCosts(kernel_seconds=2e-5, region_seconds={"full": (0.0, 3e-5)})
        >>> costs.region_seconds["full"][1] / costs.kernel_seconds
        1.5
    """

    kernel_seconds: float
    region_seconds: dict[str, tuple[float, float]]


def host_costs(rounds: int = 4, blocks: int = 4, wrappers: Mapping[str, Wrapper] | None = None) -> HostCosts:
    """The host costs of the variants of ``wrappers`` (default :data:`WRAPPERS`, which must hold ``"none"``),
    averaged over both narrow models: the step without checkpointing over its kernels; each other variant's extra
    time, less its recomputed kernels at that rate, over the forward kernels of the blocks it wraps."""
    wrappers = WRAPPERS if wrappers is None else wrappers
    per_kernel: list[float] = []
    extra: dict[str, list[float]] = {variant: [] for variant in wrappers if variant != "none"}
    for name in NARROW_MODELS:
        seconds = host_step_seconds(name, rounds, steps=2, blocks=blocks, wrappers=wrappers)
        kernels = {variant: _step_kernels(name, blocks, wrap) for variant, wrap in wrappers.items()}
        rate = seconds["none"] / kernels["none"]
        per_kernel.append(rate)
        model, x = narrow_model(name, blocks)
        forward = _kernels(model, x)
        for variant in extra:
            recomputed = (kernels[variant] - kernels["none"]) * rate
            extra[variant].append(max(0.0, seconds[variant] - seconds["none"] - recomputed) / forward)
    average = sum(per_kernel) / len(per_kernel)
    return HostCosts(average, {variant: (0.0, sum(values) / len(values)) for variant, values in extra.items()})


def priced_host_ratios(
    name: str, kernel_seconds: float, region_seconds: Mapping[str, tuple[float, float]]
) -> dict[str, float]:
    """What the planner prices a step of the narrow model ``name`` at, each of our modes over none, on a host that
    spends ``kernel_seconds`` per kernel and ``region_seconds`` per wrapped block call and per forward kernel in it
    (its :class:`~lightning_memopt.planner.hardware.Hardware`'s): every kernel of the step, recomputed ones included,
    and each wrapped block's Python work. Selective is priced keeping its expensive ops (:data:`SELECTIVE_KEPT`).

    Example::

        >>> free = dict.fromkeys(CHECKPOINT_MODES, (0.0, 0.0))
        >>> ratios = priced_host_ratios("cnn", 1e-5, free)
        >>> sorted(ratios), round(ratios["full"], 2)    # free Python: the recomputed forward kernels only
        (['full', 'none', 'offload', 'selective kept'], 1.46)
    """
    model, x = narrow_model(name)
    forward = _kernels(model, x)
    variants = {"none": "none", "full": "full", "offload": "offload", SELECTIVE_KEPT: "selective"}
    seconds = {}
    for variant, mode in variants.items():
        per_call, per_kernel = region_seconds[mode] if mode != "none" else (0.0, 0.0)
        python = len(model) * per_call + forward * per_kernel
        seconds[variant] = _step_kernels(name, None, WRAPPERS[variant]) * kernel_seconds + python
    return {variant: value / seconds["none"] for variant, value in seconds.items()}


@functools.lru_cache(maxsize=1)
def measure_host() -> HostCosts:
    """This host's costs of our modes (:func:`host_costs`), measured once a process. Selective's is the mode's own
    cost, where it keeps the expensive ops (the planner prices each block's modes and keeps the cheaper)."""
    priced = {"none": WRAPPERS["none"], "full": WRAPPERS["full"], "offload": WRAPPERS["offload"]}
    costs = host_costs(wrappers={**priced, "selective": WRAPPERS[SELECTIVE_KEPT]})
    return HostCosts(costs.kernel_seconds, {mode: costs.region_seconds[mode] for mode in CHECKPOINT_MODES})


def _built(
    name: str, blocks: int | None, wrap: Wrapper, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = narrow_model(name, blocks)
    return wrap(model.to(device)), x.to(device)


def _step_kernels(name: str, blocks: int | None, wrap: Wrapper) -> int:
    """The kernels of a steady training step (the gradients exist: backward accumulates into them)."""
    model, x = _built(name, blocks, wrap)
    _step(model, x)
    return _kernels(_step, model, x)


def _kernels(run: Callable[..., object], *args: object) -> int:
    with disable_current_modes(), KernelCounter() as counter:
        run(*args)
    return counter.kernels
