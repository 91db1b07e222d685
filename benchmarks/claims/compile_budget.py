"""Our per-block checkpointing plan against ``torch.compile``'s activation memory budget, side by side in one process.

    python benchmarks/claims/compile_budget.py [--only sapiens_tiny,r50] [--budgets 0.2,0.4,0.6,0.8] [--rounds 3]
                                        [--csv benchmarks/claims/compile_budget.csv]
    python benchmarks/claims/compile_budget.py --quick      # tiny sizes, one budget, aot_eager_decomp_partition only
    python benchmarks/claims/compile_budget.py --table      # print the docs table from the CSV

For each model and budget ``b`` (and ``b = 1.0``, the reference without checkpointing on both sides), three
variants of the same network (same seed, fp32, train mode, CPU) are built:

- **ours**: eager PyTorch with the checkpointing that ``plan_checkpointing(build, batch, b)`` picks (per block
  ``full`` / ``selective`` / ``offload`` or kept, a knapsack over the blocks); ``b`` is a fraction of *our*
  unchecked activation peak as the planner estimates it. At ``b = 1.0`` nothing is checkpointed.
- **inductor**: ``torch.compile(model, backend="inductor")`` with ``activation_memory_budget = b`` (compiled
  kernels: the "eager vs compiled" ratio);
- **aot_eager**: ``torch.compile(model, backend="aot_eager_decomp_partition")`` with the same budget: the same
  decompositions and the same min-cut partitioner, but the graphs run op by op with eager kernels (the "eager
  vs eager" ratio).

Models, fp32, loss ``output.square().mean()`` (of the logits for the classifier), sized so that the default
run (4 models × 5 budgets × 2 compiles) stays within about 15 minutes on an idle 2-core CPU: dynamo unrolls
every block into one graph, so inductor's compile time grows with the depth (measured here, on a shared
machine: full r50 at batch 8, 169 s per inductor compile and 12 s per eager step; r50 with blocks 1-1-2-1,
75-95 s cold, 19 s with the kernel cache warm; sapiens_0.3b with 4 blocks 39-46 s, with 2 blocks 8-26 s; the
4-layer ViT 19-33 s; sapiens_tiny 17-20 s; aot_eager_decomp_partition 2-10 s each): sapiens_tiny (its preset),
sapiens_0.3b cut to 2 of its 24 blocks and a 128-channel head at 256 × 192, r50's stages with 1-1-2-1 of their
3-4-14-3 blocks at batch 4, 112 × 112, and a ``transformers`` ViT built from a config (width 384, 4 layers,
random weights) at batch 8, 128 × 128, whose blocks nobody declares (the project discovers them).

What compile's budget means (read in ``torch/_functorch/partitioners.py`` and ``config.py``, torch 2.13):
``min_cut_rematerialization_partition`` reads ``torch._functorch.config.activation_memory_budget`` and hands
it to ``choose_saved_values_set``. There ``b`` is *not* a fraction of a peak: it is a fraction of the range
of *saved bytes* between saving only the graph's inputs (``b = 0``: recompute the whole forward) and the
runtime-optimal min cut (``b = 1``, which already recomputes cheap pointwise ops): the first, ever more
aggressive min cut whose ``(saved − inputs) / (default saved − inputs)`` is below ``b`` is taken, else a 0-1
knapsack (``activation_memory_budget_solver = "dp"``, runtimes from FLOP counts) picks which banned nodes to
recompute. Temporaries of the backward pass are outside that accounting. Both backends partition with it:
``aot_eager_decomp_partition`` passes ``partition_fn=min_cut_rematerialization_partition`` explicitly
(``torch/_dynamo/backends/debugging.py``), inductor's ``compile_fx`` calls it from its own ``partition_fn``.
The script checks this on every compile: it wraps ``choose_saved_values_set`` and records the budget each
joint graph was partitioned with (``graphs``, ``partitioner_budgets``) and the bytes it chose to save
(``<backend>_saved_mib``: compile's own count, saved values that are not graph inputs). The budget is set with
``torch._functorch.config.patch`` around the ``torch.compile`` *and* the first call (compilation is lazy),
after ``torch._dynamo.reset()`` so that each budget compiles afresh; the FX graph and AOTAutograd caches are
turned off for the compile so that the partitioner really runs (the C++ kernel cache of inductor stays on,
so the compile seconds of a rerun are lower than a cold first run's).

Memory: one forward + backward of each variant (after its warm-up and timed steps), at the CPU allocator
itself, so compiled and eager code are measured by the same instrument: ``torch.profiler.profile(activities=
[CPU], profile_memory=True)`` records every allocation and free of c10's CPU allocator (its
``ProfiledCPUMemoryReporter``), whoever asks for it: dispatcher ops, autograd, and inductor's generated code
(its buffers come from ``empty_strided_cpu``). Those events (``+nbytes`` / ``−nbytes``), in time order, give
the running total of bytes allocated since the step began; its maximum is the **activation peak**. What
existed before the step (weights, the batch, and the gradients, allocated up front with
``p.grad = torch.zeros_like(p)`` so that the backward adds into them in place) is the baseline and has no
events: the peak is above it by construction. Also counted: the total when the backward begins (a
``record_function`` range marks it), ``after_forward``, what the forward left for the backward, which is what
compile's budget acts on; and ``gradient_sized``, the part of the peak that the backward allocated in buffers
of exactly a parameter's size. A compiled backward returns all weight gradients together and autograd adds
them into ``.grad`` only after it returns, so they are live at once: on sapiens_0.3b below, at compile's peak,
110.05 MiB of such buffers, the weights' size to the byte, at every budget (eager autograd adds each gradient
as soon as it is made). Checked against the project's ``MemoryTracker`` (real tensors, counted at dispatch;
``tests/benchmarks/test_compile_budget.py`` repeats the checks): where every allocation is a tensor the two
agree to the byte (two sapiens_tiny ViT blocks on 2 × 12 tokens: 288,136 B both; an MLP 256-1024-256 on 512
rows: 7,865,352 B both). With convolutions the allocator sees more: workspaces a convolution's backward takes
from the allocator without making a tensor, which the tracker cannot see (sapiens_tiny, batch 2, 64 × 48:
3,241,876 B against 2,972,628 B, +9.1 %; live at the allocator's peak: 269,644 B that a convolution's backward
allocated itself; the backward of its 16 × 16 patch embedding alone takes 1.8 MB that way). That is real memory,
counted alike for both sides. Not seen by either: memory a kernel library takes from ``malloc``
itself. The host copies of an ``offload`` block (made inside the project's ``host_memory()``, marked with a
profiler range by this script) are host memory, as the project counts them everywhere: left out of the
activation peak (what a GPU would hold) and reported apart (``our_host_mib``, equal to the tracker's
``peak_host_bytes`` to the byte on sapiens_tiny); on this CPU machine they are the same RAM, and
``our_ram_peak_mib`` counts everything.

Time: the three variants of a budget are timed in interleaved rounds (one untimed warm-up round, compile
included, then ``--rounds`` rounds); each gets the fastest of its steps. Ratios: ours / inductor (eager vs
compiled) and ours / aot_eager (eager vs eager).

Private torch names, all in this benchmark only (the package keeps to public ones): ``torch._functorch.config``
(the budget and the AOTAutograd cache switch: there is no public knob), ``torch._inductor.config`` (the FX
graph cache switch), ``torch._functorch.partitioners`` (to see which budget each graph was partitioned with and
what it saved), ``torch._dynamo.reset`` (to recompile per budget), and the profiler's
``prof.profiler.kineto_results.experimental_event_tree()`` with ``torch._C._profiler._EventType`` (each
allocation event with its time, size, address and the ranges it happened in: the public ``key_averages`` only
sums them per op).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._functorch.partitioners as partitioners
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, prose, read_rows, write_csv
from torch import nn
from torch.profiler import ProfilerActivity, profile

import lightning_memopt.checkpointing.offload as offload
from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.models import IResNet, create_model
from lightning_memopt.planner import plan_checkpointing
from lightning_memopt.vocabulary import NO_CHECKPOINT

_MIB = 2**20
BUDGETS = (0.2, 0.4, 0.6, 0.8)
PEAK_TARGET, TIME_TARGET = 1.0, 1.05  # ours over compile's, at most, at every budget
COMPARED = ("peak_vs_inductor", "time_vs_inductor", "peak_vs_aot_eager", "time_vs_aot_eager")
BACKENDS = ("inductor", "aot_eager_decomp_partition")
SHORT = {"inductor": "inductor", "aot_eager_decomp_partition": "aot_eager"}
Batch = tuple[torch.Tensor, ...]


def _square_mean(output: Any) -> torch.Tensor:
    """The loss of every case: the mean square of the output (of the logits for a classifier)."""
    return getattr(output, "logits", output).square().mean()


@dataclass
class Case:
    """One model: a zero-argument factory, its batch, and the same at tiny sizes for ``--quick``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Batch]
    quick_build: Callable[[], nn.Module]
    quick_batch: Callable[[], Batch]


def _images(batch: int, height: int, width: int) -> Callable[[], Batch]:
    def make() -> Batch:
        return (torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(0)),)

    return make


def _vit_small(hidden: int = 384, layers: int = 4, heads: int = 6, image: int = 128) -> nn.Module:
    """A ``transformers`` ViT built from a config (random weights, nothing downloaded): a model that declares
    nothing, whose blocks the project discovers."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=image,
        patch_size=16,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_labels=100,
    )
    return ViTForImageClassification(config)


CASES = {
    "sapiens_tiny": Case(
        "sapiens_tiny (batch 8, 64×48)",
        lambda: create_model("sapiens_tiny"),
        _images(8, 64, 48),
        lambda: create_model("sapiens_tiny"),
        _images(2, 64, 48),
    ),
    "sapiens_0.3b": Case(
        "sapiens_0.3b (2 of 24 blocks, head 128, batch 1, 256×192)",
        lambda: create_model("sapiens_0.3b", depth=2, head_channels=128, position_grid=(16, 12), image_size=(256, 192)),
        _images(1, 256, 192),
        lambda: create_model(
            "sapiens_0.3b", embed_dim=128, depth=4, num_heads=4, ffn_dim=512, head_channels=16, position_grid=(8, 6)
        ),
        _images(2, 128, 96),
    ),
    "r50": Case(
        "r50 (blocks 1-1-2-1 of 3-4-14-3, batch 4, 112×112)",
        lambda: IResNet(layers=(1, 1, 2, 1)),
        _images(4, 112, 112),
        lambda: create_model("iresnet_tiny"),
        _images(2, 32, 32),
    ),
    "vit_small": Case(
        "transformers ViT (384 wide, 4 layers, batch 8, 128×128)",
        _vit_small,
        _images(8, 128, 128),
        lambda: _vit_small(hidden=32, layers=2, heads=2, image=32),
        _images(2, 32, 32),
    ),
}


# -- the instrument -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocatorPeak:
    """Bytes the CPU allocator held above what it held when a step began.

    ``peak``: the most at once (the activation peak); ``after_forward``: when the backward began (what the forward
    left for it: saved activations, the loss). Both leave out the host copies of offloaded activations, which a
    device would not hold (on this CPU machine they are the same RAM): those are ``host`` (the most held at once),
    and ``ram_peak`` is the most of everything at once. ``gradient_sized``: see :func:`allocator_peak`.
    """

    peak: int
    after_forward: int
    host: int = 0
    ram_peak: int = 0
    gradient_sized: int = 0


_BACKWARD = "compile_budget.backward"
_HOST = "compile_budget.host"


@contextlib.contextmanager
def _marked_host_copies() -> Iterator[None]:
    """Mark the host copies that offloading makes (inside ``host_memory()``) with a profiler range."""
    original = offload.host_memory

    @contextlib.contextmanager
    def marked() -> Iterator[None]:
        with torch.profiler.record_function(_HOST), original():
            yield

    offload.host_memory = marked
    try:
        yield
    finally:
        offload.host_memory = original


def _allocations(nodes: list[Any], host: bool = False) -> Iterator[tuple[int, int, int, bool]]:
    """``(time, nbytes, address, inside a host-copy range)`` of every allocator event under ``nodes``."""
    for node in nodes:
        if node.tag == torch._C._profiler._EventType.Allocation and node.extra_fields.device.type == "cpu":
            yield node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, host
        yield from _allocations(node.children, host or node.name == _HOST)


def _named_start(nodes: list[Any], name: str) -> int | None:
    for node in nodes:
        if node.name == name:
            return node.start_time_ns
        found = _named_start(node.children, name)
        if found is not None:
            return found
    return None


def allocator_peak(forward: Callable[[], torch.Tensor], parameter_sizes: Iterable[int] = ()) -> AllocatorPeak:
    """Run ``forward()`` (returning a scalar loss) and its backward, counting at the CPU allocator.

    Built from the profiler's memory events: one per allocation (``+nbytes``) and free (``-nbytes``) of c10's CPU
    allocator, whoever asked for it (an eager op, autograd, inductor's generated code), in time order. Memory that
    existed before the step has no allocation event; its frees are not reported either. The backward is marked
    with a ``record_function`` range (the events before it are the forward's), and so is each host copy that
    offloading makes: its allocation, and later the free of the same address, count as host memory.
    ``gradient_sized``: of the peak, the buffers the backward allocated with the size of one of
    ``parameter_sizes`` (the model's parameters' byte sizes): weight gradients not yet added into ``.grad``.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _marked_host_copies():
        loss = forward()
        with torch.profiler.record_function(_BACKWARD):
            loss.backward()
        del loss
    tree = prof.profiler.kineto_results.experimental_event_tree()
    backward_start = _named_start(tree, _BACKWARD)
    assert backward_start is not None, "the backward's range is missing from the profile"
    sizes = set(parameter_sizes)
    live = peak = after_forward = host = host_peak = ram = ram_peak = gradient_sized = gradient_sized_at_peak = 0
    host_addresses: set[int] = set()
    gradient_addresses: set[int] = set()
    for when, nbytes, address, in_host_copy in sorted(_allocations(tree), key=lambda event: event[0]):
        ram += nbytes
        ram_peak = max(ram_peak, ram)
        if nbytes > 0 and in_host_copy:
            host_addresses.add(address)
        if address in host_addresses:
            if nbytes < 0:
                host_addresses.discard(address)
            host += nbytes
            host_peak = max(host_peak, host)
            continue
        if nbytes > 0 and when >= backward_start and nbytes in sizes:
            gradient_addresses.add(address)
        if address in gradient_addresses:
            if nbytes < 0:
                gradient_addresses.discard(address)
            gradient_sized += nbytes
        live += nbytes
        if live > peak:
            peak, gradient_sized_at_peak = live, gradient_sized
        if when < backward_start:
            after_forward += nbytes
    return AllocatorPeak(peak, after_forward, host_peak, ram_peak, gradient_sized_at_peak)


def tracker_peak(model: nn.Module, batch: Batch, loss: Callable[[Any], torch.Tensor] = _square_mean) -> int:
    """The same activation peak counted by the project's ``MemoryTracker`` on real tensors: its peak during one
    forward + backward less what it counted before (weights, gradients, batch). The reference of the instrument."""
    tracker = MemoryTracker()
    with tracker:
        tracker.track_module(model)
        tracker.track(list(batch), "inputs")
        baseline = tracker.live_bytes
        with tracker.in_phase("forward"):
            value = loss(model(*batch))
        with tracker.in_phase("backward"):
            value.backward()
        del value
    tracker.remove_hooks()
    return tracker.peak.total_bytes - baseline


# -- the variants ---------------------------------------------------------------------------------------------
def _built(build: Callable[[], nn.Module]) -> nn.Module:
    """The model of a case, seeded, in train mode, with its gradients allocated up front (they are the baseline)."""
    torch.manual_seed(0)
    model = build().train()
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    return model


@dataclass
class Variant:
    """One way to run a training step: ours (eager, planned checkpointing) or a compiled model."""

    name: str
    model: nn.Module
    runner: Callable[..., Any]
    seconds: list[float] = field(default_factory=list)
    compile_seconds: float = float("nan")
    budgets_seen: list[float] = field(default_factory=list)
    saved_bytes: int = 0

    def forward(self, batch: Batch) -> torch.Tensor:
        return _square_mean(self.runner(*batch))

    def step(self, batch: Batch) -> None:
        self.forward(batch).backward()


@contextlib.contextmanager
def _watching_partitioner(variant: Variant) -> Iterator[None]:
    """Record the budget every joint graph is partitioned with and the bytes the partitioner chose to save."""
    original = partitioners.choose_saved_values_set

    def watched(joint_graph: Any, node_info: Any, memory_budget: float = 1) -> Any:
        saved = original(joint_graph, node_info, memory_budget=memory_budget)
        variant.budgets_seen.append(float(memory_budget))
        variant.saved_bytes += sum(partitioners._size_of(node) for node in saved if node.op != "placeholder")
        return saved

    partitioners.choose_saved_values_set = watched
    try:
        yield
    finally:
        partitioners.choose_saved_values_set = original


def compiled_variant(build: Callable[[], nn.Module], batch: Batch, backend: str, budget: float) -> Variant:
    """``torch.compile(model, backend)`` compiled now (its first step, timed) with ``activation_memory_budget``."""
    model = _built(build)
    variant = Variant(SHORT[backend], model, model)
    with (
        _watching_partitioner(variant),
        functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False),
        inductor_config.patch(fx_graph_cache=False),
    ):
        started = time.perf_counter()
        variant.runner = torch.compile(model, backend=backend)
        variant.step(batch)
        variant.compile_seconds = time.perf_counter() - started
    if not variant.budgets_seen:
        raise RuntimeError(f"{backend}: no joint graph went through the min-cut partitioner")
    return variant


@dataclass
class Plan:
    """What the planner chose for one budget, and its estimates."""

    modes: dict[str, str]
    activation_bytes: float  # NaN at the reference (no plan)
    unchecked_bytes: float


def our_variant(build: Callable[[], nn.Module], batch: Batch, budget: float) -> tuple[Variant, Plan]:
    """Eager, with the checkpointing the planner picks for ``budget``; at 1.0 (the reference) nothing is checkpointed
    and the planner is not asked (its estimates are filled in from the other budgets' plans)."""
    model = _built(build)
    if budget >= 1:
        return Variant("ours", model, model), Plan({}, math.nan, math.nan)

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        return _square_mean(model(*batch))

    choice = plan_checkpointing(build, batch, budget, loss_fn=loss_fn, precision="32-true")
    modes = {name: mode for name, mode in choice.modes.items() if mode != NO_CHECKPOINT}
    if modes:
        apply_activation_checkpointing(model, choice.policy())
    plan = Plan(modes, choice.activation_bytes, choice.unchecked_activation_bytes)
    return Variant("ours", model, model), plan


def _modes_label(modes: dict[str, str]) -> str:
    counts = Counter(modes.values())
    return " ".join(f"{mode}×{count}" for mode, count in sorted(counts.items())) or "none"


def time_rounds(variants: list[Variant], batch: Batch, rounds: int) -> None:
    """One untimed warm-up round, then ``rounds`` timed rounds, the variants interleaved within each round."""
    for round_index in range(rounds + 1):
        for variant in variants:
            started = time.perf_counter()
            variant.step(batch)
            if round_index:
                variant.seconds.append(time.perf_counter() - started)


_BACKEND_COLUMNS = (
    "peak_mib",
    "after_forward_mib",
    "gradient_sized_mib",
    "saved_mib",
    "seconds",
    "compile_seconds",
    "graphs",
    "partitioner_budgets",
)


def measure_budget(case: Case, budget: float, rounds: int, backends: tuple[str, ...], quick: bool) -> dict:
    """One row: ours and each backend's compile at ``budget``, timed in interleaved rounds, then their peaks."""
    build, batch = (case.quick_build, case.quick_batch()) if quick else (case.build, case.batch())
    torch._dynamo.reset()
    ours, plan = our_variant(build, batch, budget)
    variants = [ours] + [compiled_variant(build, batch, backend, budget) for backend in backends]
    time_rounds(variants, batch, rounds)
    sizes = {parameter.nbytes for parameter in ours.model.parameters()}
    measured = {
        variant.name: allocator_peak(lambda variant=variant: variant.forward(batch), sizes) for variant in variants
    }
    row: dict[str, Any] = {
        "model": f"{case.name.split(' (')[0]} (--quick sizes)" if quick else case.name,
        "budget": budget,
        "weights_mib": sum(parameter.nbytes for parameter in ours.model.parameters()) / _MIB,
        "our_modes": _modes_label(plan.modes),
        "our_estimate_mib": plan.activation_bytes / _MIB,
        "our_unchecked_estimate_mib": plan.unchecked_bytes / _MIB,
        "our_peak_mib": measured["ours"].peak / _MIB,
        "our_after_forward_mib": measured["ours"].after_forward / _MIB,
        "our_host_mib": measured["ours"].host / _MIB,
        "our_ram_peak_mib": measured["ours"].ram_peak / _MIB,
        "our_gradient_sized_mib": measured["ours"].gradient_sized / _MIB,
        "our_seconds": min(ours.seconds),
    }
    for backend in BACKENDS:
        short = SHORT[backend]
        variant = next((v for v in variants if v.name == short), None)
        if variant is None:  # --quick measures aot_eager only
            row.update({f"{short}_{column}": math.nan for column in _BACKEND_COLUMNS})
            row.update({f"peak_vs_{short}": math.nan, f"time_vs_{short}": math.nan})
            continue
        row[f"{short}_peak_mib"] = measured[short].peak / _MIB
        row[f"{short}_after_forward_mib"] = measured[short].after_forward / _MIB
        row[f"{short}_gradient_sized_mib"] = measured[short].gradient_sized / _MIB
        row[f"{short}_saved_mib"] = variant.saved_bytes / _MIB
        row[f"{short}_seconds"] = min(variant.seconds)
        row[f"{short}_compile_seconds"] = variant.compile_seconds
        row[f"{short}_graphs"] = len(variant.budgets_seen)
        row[f"{short}_partitioner_budgets"] = " ".join(f"{seen:g}" for seen in sorted(set(variant.budgets_seen)))
        row[f"peak_vs_{short}"] = measured["ours"].peak / measured[short].peak
        row[f"time_vs_{short}"] = row["our_seconds"] / row[f"{short}_seconds"]
    del variants, ours
    gc.collect()
    torch._dynamo.reset()
    return row


def measure(key: str, budgets: tuple[float, ...], rounds: int, backends: tuple[str, ...], quick: bool) -> list[dict]:
    """The rows of one model: the reference (budget 1.0) first, then every budget; each peak also as a fraction of
    its own side's reference peak."""
    rows = []
    for budget in (1.0, *budgets):
        row = measure_budget(CASES[key], budget, rounds, backends, quick)
        reference = rows[0] if rows else row
        if math.isnan(reference["our_unchecked_estimate_mib"]):  # the reference's estimates: from the first plan
            reference["our_estimate_mib"] = reference["our_unchecked_estimate_mib"] = row["our_unchecked_estimate_mib"]
        row["our_fraction"] = row["our_peak_mib"] / reference["our_peak_mib"]
        for backend in BACKENDS:
            short = SHORT[backend]
            row[f"{short}_fraction"] = row[f"{short}_peak_mib"] / reference[f"{short}_peak_mib"]
        rows.append(row)
        print_row(row)
    return rows


_HEADER = (
    f"{'model':<58}{'b':>5} {'ours: modes':<22}{'est MiB':>9}{'peak MiB':>10}{'s':>8}"
    f" |{'ind. MiB':>10}{'s':>8}{'comp s':>8} |{'aot MiB':>10}{'s':>8}{'comp s':>8}"
    f" |{'peak/ind':>9}{'t/ind':>7}{'peak/aot':>9}{'t/aot':>7}"
)


def print_row(row: dict) -> None:
    print(
        f"{row['model']:<58}{row['budget']:>5.2f} {row['our_modes']:<22}{row['our_estimate_mib']:>9.1f}"
        f"{row['our_peak_mib']:>10.1f}{row['our_seconds']:>8.3f}"
        f" |{row['inductor_peak_mib']:>10.1f}{row['inductor_seconds']:>8.3f}{row['inductor_compile_seconds']:>8.1f}"
        f" |{row['aot_eager_peak_mib']:>10.1f}{row['aot_eager_seconds']:>8.3f}"
        f"{row['aot_eager_compile_seconds']:>8.1f}"
        f" |{row['peak_vs_inductor']:>9.2f}{row['time_vs_inductor']:>7.2f}"
        f"{row['peak_vs_aot_eager']:>9.2f}{row['time_vs_aot_eager']:>7.2f}",
        flush=True,
    )


# -- the docs table -------------------------------------------------------------------------------------------
def _mark(value: float, limit: float) -> str:
    """``value`` to two decimals, bold where it misses its target (above ``limit``); a dash if not measured."""
    if math.isnan(value):
        return "–"
    return f"**{value:.2f}**" if value > limit else f"{value:.2f}"


def _peak_cell(row: dict[str, str], side: str) -> str:
    """A side's activation peak, its fraction of the side's own unchecked peak, and what of it are gradient-sized
    buffers of the backward (for a compiled backward: the weight gradients it returns together)."""
    peak, fraction, budget = float(row[f"{side}_peak_mib"]), float(row[f"{side}_fraction"]), float(row["budget"])
    if math.isnan(peak):
        return "–"
    cell = f"{peak:.1f} ({fraction:.2f})" if budget < 1 else f"{peak:.1f}"
    gradients = float(row[f"{side}_gradient_sized_mib"])
    return f"{cell}, grads {gradients:.1f}" if side != "our" and gradients else cell


def table(path: Path) -> str:
    """The docs' table: per model and budget, the three activation peaks (each also as a fraction of its side's own
    unchecked peak), what each holds when its backward begins, and ours over each compile's peak and step time; a
    missed target in bold."""
    lines, previous = [], None
    for row in read_rows(path):
        model = row["model"].replace(" (", ", ").rstrip(")")
        budget = float(row["budget"])
        cells = [model if model != previous else "", f"{budget:g}", row["our_modes"]]
        for side in ("our", "inductor", "aot_eager"):
            cells.append(_peak_cell(row, side))
        host = float(row["our_host_mib"])
        cells[-3] += f" + {host:.1f} host" if host else ""
        after = (float(row[f"{side}_after_forward_mib"]) for side in ("our", "inductor", "aot_eager"))
        cells.append(" / ".join("–" if math.isnan(value) else f"{value:.1f}" for value in after))
        cells += [_mark(float(row[column]), _target(column)) for column in COMPARED]
        lines.append(cells)
        previous = model
    columns = [
        "model",
        "budget",
        "ours: blocks",
        "ours MiB",
        "inductor MiB",
        "aot_eager MiB",
        "after forward MiB: ours / ind. / aot",
        "peak (no host copies) ÷ inductor",
        "time ÷ inductor",
        "peak (no host copies) ÷ aot_eager",
        "time ÷ aot_eager",
    ]
    return markdown_table(columns, lines)


def _target(column: str) -> float:
    return PEAK_TARGET if column.startswith("peak") else TIME_TARGET


def targets(path: Path) -> str:
    """The docs' targets: at each budget below 1, how often ours meets each compile's peak and time, and where not."""
    rows = [row for row in read_rows(path) if float(row["budget"]) < 1]
    budgets = ", ".join(dict.fromkeys(f"{float(row['budget']):g}" for row in rows))
    lines = [
        f"Targets at budgets {budgets} (the rows at 1 are the reference without checkpointing), {len(rows)} budgets "
        "in all: our peak ≤ compile's (ours without its host copies, which on this CPU are the same RAM) and our step "
        f"time ≤ {TIME_TARGET} × compile's (CPU), for inductor (eager vs compiled) and for aot_eager (eager vs eager):",
        "",
    ]
    for column in COMPARED:
        missed: dict[str, list[str]] = {}
        for row in rows:
            if float(row[column]) > _target(column):
                missed.setdefault(row["model"].split(" (")[0], []).append(
                    f"{float(row['budget']):g} ({float(row[column]):.2f})"
                )
        where = "; ".join(f"{model} at {', '.join(cells)}" for model, cells in missed.items())
        met = len(rows) - sum(map(len, missed.values()))
        lines.append(
            f"- **{column.replace('_vs_', ' ÷ ')}**: met at {met} of {len(rows)}"
            + (f"; missed on {where}." if where else ".")
        )
    return prose(*lines)


def _budgets(text: str) -> tuple[float, ...]:
    budgets = tuple(float(part) for part in text.split(","))
    if any(not 0 <= budget < 1 for budget in budgets):
        raise argparse.ArgumentTypeError(f"budgets must lie in [0, 1) (1.0 is always measured): {text!r}")
    return budgets


def main(argv: list[str] | None = None) -> list[dict]:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--budgets", type=_budgets, default=BUDGETS, help="comma-separated fractions in [0, 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, budget 0.4, aot_eager only, one round")
    args = parser.parse_args(argv)
    keys = args.only.split(",")
    unknown = sorted(set(keys) - set(CASES))
    if unknown:
        parser.error(f"unknown --only entries {unknown}; valid choices: {', '.join(CASES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    budgets, rounds, backends = args.budgets, args.rounds, BACKENDS
    if args.quick:
        budgets, rounds, backends = (0.4,), 1, ("aot_eager_decomp_partition",)
    print(_HEADER)
    rows = []
    for key in keys:
        rows += measure(key, budgets, rounds, backends, args.quick)
    write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
