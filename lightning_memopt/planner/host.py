"""The host's share of a step: what Python, autograd and dispatch cost per kernel, and what checkpointing adds.

A GPU runs a step's kernels while the host queues the next ones; when the host takes longer than the
device (small batches, narrow layers, many blocks wrapped), the host sets the step's time. That work
is the same on a CPU as beside a GPU, so it is measured here on narrow models with tiny tensors,
where the arithmetic is negligible: a residual CNN with batch norm and a pre-norm transformer, each
step timed without checkpointing and with each mode of ours on every block, interleaved round by round, the
fastest round of each kept.
``selective`` is the mode as a model gets it: the narrow models' blocks run as traced graphs
(:mod:`~lightning_memopt.checkpointing.traced_graph`) that keep their matmuls on every call; a block no trace can
follow goes the dispatch-mode way, where on tensors this small keeping does not pay and after its first calls the
block is recomputed in full (:mod:`~lightning_memopt.checkpointing.selective_payoff`). ``selective kept`` keeps them
on every call either way: the cost of the mode itself, which the planner prices.
What a mode adds beyond the kernels it recomputes is priced per wrapped call and per forward op inside it, fitted
on both narrow models wrapped one and four blocks a call (:func:`host_costs`); ``benchmarks/host_steps.py`` holds what
checks the fit (``torch.utils.checkpoint``'s variant, the held-out models, the priced ratios) and
``benchmarks/claims/host_overhead.py`` runs it.

Example::

    >>> seconds = host_step_seconds("cnn", rounds=1, steps=1)
    >>> sorted(seconds)
    ['full', 'none', 'offload', 'selective', 'selective kept']
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lightning_memopt.checkpointing.wrap import checkpoint_modules
from lightning_memopt.memory.work import KernelCounter
from lightning_memopt.private_api import disable_current_modes
from lightning_memopt.vocabulary import CHECKPOINT_MODES

Wrapper = Callable[[nn.Sequential], nn.Module]


def _ours(mode: str) -> Wrapper:
    def wrap(model: nn.Sequential) -> nn.Module:
        checkpoint_modules(model, {"modules": [str(i) for i in range(len(model))], "mode": mode})
        return model

    return wrap


def _selective_kept(model: nn.Sequential) -> nn.Module:
    """Selective on every block, keeping the expensive ops even where that does not pay (a block that goes the
    dispatch-mode way recomputes in full after its first calls on tiny tensors): the cost of the mode itself."""
    wrapped = _ours("selective")(model)
    for block in wrapped:
        block.forward.state.selective.pays = True
    return wrapped


SELECTIVE_KEPT = "selective kept"
# how each variant treats every block of a narrow model
WRAPPERS: dict[str, Wrapper] = {
    "none": lambda model: model,
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
    with disable_current_modes():
        models = {variant: _built(name, blocks, wrap, device) for variant, wrap in wrappers.items()}
        runs = {variant: functools.partial(_step, model, x) for variant, (model, x) in models.items()}
        return fastest_seconds(runs, rounds, steps=steps, device=device)


def fastest_seconds(
    runs: Mapping[str, Callable[[], object]],
    rounds: int,
    steps: int = 1,
    warmups: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """The fastest round of each of ``runs``, per call: the runs interleaved round by round, ``steps`` calls a round,
    after ``warmups`` rounds, on one thread; on a ``device`` other than the CPU each round waits for it before its
    clock starts and stops.

    Example::

        >>> seconds = fastest_seconds({"short": lambda: None, "long": lambda: sum(range(100_000))}, rounds=3)
        >>> seconds["short"] < seconds["long"]
        True
    """
    device = torch.device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fastest = dict.fromkeys(runs, float("inf"))
        for round_index in range(warmups + rounds):
            for name, run in runs.items():
                _synchronize(device)
                started = time.perf_counter()
                for _ in range(steps):
                    run()
                _synchronize(device)
                if round_index >= warmups:
                    fastest[name] = min(fastest[name], (time.perf_counter() - started) / steps)
    finally:
        torch.set_num_threads(threads)
    return fastest


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@dataclass(frozen=True)
class HostCosts:
    """The host's time per kernel, and what each checkpointing mode adds per wrapped block call and per forward
    op inside it, beyond queuing the kernels it recomputes (as the planner prices a region: ``(per call, per op)``).

    Example::

        >>> costs = HostCosts(kernel_seconds=2e-5, region_seconds={"full": (3e-4, 4e-6)})
        >>> per_call, per_op = costs.region_seconds["full"]
        >>> round(per_call / costs.kernel_seconds, 1)
        15.0
    """

    kernel_seconds: float
    region_seconds: dict[str, tuple[float, float]]


GROUPINGS = (1, 4)  # blocks per wrapped call: the same ops under four times as many calls, or a quarter as many


def host_costs(rounds: int = 4, blocks: int = 8, wrappers: Mapping[str, Wrapper] | None = None) -> HostCosts:
    """The host costs of the variants of ``wrappers`` (default :data:`WRAPPERS`, which must hold ``"none"``),
    from both narrow models of ``blocks`` blocks, each wrapped block by block and in groups (:data:`GROUPINGS`):
    the step without checkpointing over its kernels; and each other variant's extra time, less its recomputed
    kernels at that rate, fitted as a cost per wrapped call and per forward op inside it
    (:func:`fit_region_seconds`). Either alone misprices: with the same ops under a quarter of the calls, full
    checkpointing's extra time falls by more than half, and per forward kernel a transformer's block costs twice
    a CNN's (its views and reshapes are ops, not kernels)."""
    wrappers = WRAPPERS if wrappers is None else wrappers
    per_kernel: list[float] = []
    points: dict[str, list[tuple[float, float, float]]] = {variant: [] for variant in wrappers if variant != "none"}
    for name in NARROW_MODELS:
        model, x = narrow_model(name, blocks)
        forward_ops = _counted(model, x).ops
        for group in GROUPINGS:
            grouped = {variant: in_groups(wrap, group) for variant, wrap in wrappers.items()}
            seconds = host_step_seconds(name, rounds, steps=2, blocks=blocks, wrappers=grouped)
            kernels = {variant: step_kernels(name, blocks, wrap) for variant, wrap in grouped.items()}
            rate = seconds["none"] / kernels["none"]
            per_kernel.append(rate)
            for variant in points:
                extra = seconds[variant] - seconds["none"] - (kernels[variant] - kernels["none"]) * rate
                points[variant].append((_calls(blocks, group), forward_ops, extra))
    average = sum(per_kernel) / len(per_kernel)
    return HostCosts(average, {variant: fit_region_seconds(found) for variant, found in points.items()})


def fit_region_seconds(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """The ``(per call, per op)`` seconds that fit ``points`` of ``(calls, ops, extra seconds)`` best in least
    squares, neither negative (where the joint fit makes one negative, the other is fitted alone).

    Example::

        >>> fit_region_seconds([(8, 100, 8e-3 + 1e-4), (2, 100, 2e-3 + 1e-4), (8, 300, 8e-3 + 3e-4)])
        (0.001, 1e-06)
        >>> fit_region_seconds([(4, 100, 1e-3), (1, 100, 1e-3), (4, 200, 2e-3)])   # no cost per call
        (0.0, 1e-05)
    """
    calls, ops, extra = (torch.tensor(column, dtype=torch.float64) for column in zip(*points, strict=True))
    joint = torch.linalg.lstsq(torch.stack([calls, ops], dim=1), extra.unsqueeze(1)).solution.squeeze(1)
    per_call, per_op = (_to_picoseconds(float(value)) for value in joint)
    if per_call >= 0 and per_op >= 0:
        return per_call, per_op
    columns = (calls, ops)
    alone = [max(0.0, _to_picoseconds(float((column * extra).sum() / (column * column).sum()))) for column in columns]
    residuals = [float(((extra - value * column) ** 2).sum()) for value, column in zip(alone, columns, strict=True)]
    return (alone[0], 0.0) if residuals[0] <= residuals[1] else (0.0, alone[1])


def _to_picoseconds(seconds: float) -> float:
    return round(seconds, 12) + 0.0  # drops what float64 arithmetic leaves of an exact fit (and a -0.0)


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


def in_groups(wrap: Wrapper, group: int) -> Wrapper:
    """``wrap`` applied to the model's blocks taken ``group`` at a time (each group one wrapped call).

    Example::

        >>> wrapped = in_groups(WRAPPERS["full"], 4)(narrow_model("cnn", blocks=8)[0])
        >>> len(wrapped), len(wrapped[0])
        (2, 4)
    """
    if group == 1:
        return wrap

    def grouped(model: nn.Sequential) -> nn.Module:
        blocks = list(model)
        return wrap(nn.Sequential(*(nn.Sequential(*blocks[i : i + group]) for i in range(0, len(blocks), group))))

    return grouped


def _calls(blocks: int, group: int) -> int:
    """The wrapped calls of ``blocks`` blocks taken ``group`` at a time (the last group may be short)."""
    return -(-blocks // group)


def step_kernels(name: str, blocks: int | None, wrap: Wrapper) -> int:
    """The kernels of a steady training step (the gradients exist: backward accumulates into them)."""
    model, x = _built(name, blocks, wrap)
    _step(model, x)
    return _counted(_step, model, x).kernels


def _counted(run: Callable[..., object], *args: object) -> KernelCounter:
    with disable_current_modes(), KernelCounter() as counter:
        run(*args)
    return counter


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


NARROW_MODELS = ("cnn", "transformer")  # the host's costs are fitted on these
# name: (block, default blocks, input shape); benchmarks/host_steps.py adds the held-out models that check the fit
NARROW_BUILDERS: dict[str, tuple[Callable[[], nn.Module], int, tuple[int, ...]]] = {
    "cnn": (Bottleneck, 16, (2, 8, 8, 8)),
    "transformer": (EncoderBlock, 12, (2, 8, 16)),
}


def narrow_model(name: str, blocks: int | None = None) -> tuple[nn.Sequential, torch.Tensor]:
    """A narrow model of ``name`` (``"cnn"``: 16 bottlenecks; ``"transformer"``: 12 encoder blocks; or ``blocks``
    of them) and its input: a few blocks on tiny tensors, where the host sets a step's time.

    Raises:
        ValueError: an unknown ``name``, listing :data:`NARROW_BUILDERS`.

    Example::

        >>> model, x = narrow_model("transformer", blocks=2)
        >>> len(model), tuple(model(x).shape)
        (2, (2, 8, 16))
    """
    if name not in NARROW_BUILDERS:
        raise ValueError(f"Unknown `name`={name!r}; valid choices: {', '.join(NARROW_BUILDERS)}")
    block, default, shape = NARROW_BUILDERS[name]
    return nn.Sequential(*(block() for _ in range(blocks or default))), torch.randn(*shape)
