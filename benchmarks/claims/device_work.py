"""The device work of each checkpointing mode, counted exactly on the CPU in fake mode: what a GPU's time follows.

One training step (forward and backward) of each case runs under ``FakeTensorMode`` (nothing is allocated) with
no checkpointing and with each mode on the model's blocks, and is counted at dispatch level:

- FLOPs: PyTorch's flop formulas (``torch.utils.flop_counter``) plus the CPU flash-attention kernels they lack;
- kernels: aten ops less views, allocations and copies over the host link (what launches a kernel on a GPU);
- bytes written by those kernels;
- host-link bytes: what offloading copies to the host (and back: the same again);
- Python calls on the hot path: calls of Python dispatch modes (selective recomputation's) and of saved-tensor
  hooks (offload's, ``torch.utils.checkpoint``'s), per step and per wrapped block.

These are what a GPU's step time is made of: FLOPs where the device is the bound, kernels and Python calls where
its host is (the H200's host spent about 50 µs a kernel), bytes over the link for offload. Each is exact, so a
mode's excess over its physical limit shows without a GPU. The limits (issue 49): full recomputation at most one
more forward of the wrapped blocks (FLOPs ≤ 1.34× none's, kernels added ≤ the wrapped blocks' forward kernels);
selective at none's FLOPs, no more kernels than full, at most 4 Python calls per wrapped block. A case whose blocks
have a memory-lean recomputation of their own (Sapiens's head) gets a ``lean`` row too: full checkpointing by those
paths, the planner's alternative where plain recomputation holds too much (not held to full's limits).
``--check`` exits 1 when a limit is missed and says which.

    python benchmarks/claims/device_work.py             # the reference sizes, ~2 minutes on 2 cores
    python benchmarks/claims/device_work.py --reduced   # the tiny presets (what the default test run holds)
    python benchmarks/claims/device_work.py --table     # the docs table from the CSV
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv
from gpu_truth.cases import Case, face, normals, tracking
from torch import Tensor, nn

from lightning_memopt.checkpointing import checkpoint_modules, lean_recompute, remove_activation_checkpointing
from lightning_memopt.memory.step_parts import materialise, training_step_fn
from lightning_memopt.memory.tracker import allocating_on_host
from lightning_memopt.memory.work import WorkCounter
from lightning_memopt.private_api import FakeTensorMode, tree_map

MODES = {"none": None, "full": "auto", "selective": "selective", "offload": "offload", "lean": "lean"}
FULL_FLOPS_LIMIT = 1.34  # one more forward of the wrapped blocks: at most 4/3 of a step (issue 49)
SELECTIVE_CALLS_LIMIT = 4  # Python calls on the hot path per wrapped block (issue 49)
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_HOT_PATH_MODULES = ("lightning_memopt.checkpointing", "torch.utils.checkpoint")
_H200_TIMES = (
    Path(__file__).resolve().parents[1] / "calibration" / "step_time_compute_bound_h200.csv"
)  # measured at 11b0cf0


class ViTB16(nn.Module):
    """A ViT-B/16 written the way other projects write one (it declares nothing to lightning_memopt)."""

    def __init__(self, depth: int = 12, dim: int = 768, heads: int = 12, classes: int = 1000, patch: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.layers = nn.ModuleList(_EncoderLayer(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(1))


class _EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


def vit(batch: int, size: int = 224, **options: int) -> Case:
    """The foreign ViT at ``batch`` images of ``size``², classified over 1000 classes with cross-entropy."""

    def make_batch() -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, size, size, generator=generator)
        return images, torch.randint(0, options.get("classes", 1000), (batch,), generator=generator)

    name = "vit_b16" if not options else "vit_tiny"
    return Case(f"{name} b{batch} {size}²", name, lambda: ViTB16(**options), make_batch)


REFERENCE = (
    face("r100", 128),
    normals("sapiens_0.3b", 2, 1024, 768),
    tracking("cotracker3", 16, 384, 384, 512),
    vit(32),
)
REDUCED = (
    face("iresnet_tiny", 8, 32),
    normals("sapiens_tiny", 2, 64, 48),
    tracking("cotracker3_tiny", 8, 16, 64, 64),
    vit(4, 32, depth=4, dim=64, heads=4, classes=10, patch=8),
)


@dataclass
class StepWork:
    """What one training step did on the device, and what Python work its hot path called."""

    flops: float
    kernels: float
    bytes_written: float
    link_bytes: float  # copied to the host (and as many back)
    python_calls: int
    wrapped: int  # the blocks the mode wrapped
    cut: int  # of those, the blocks whose lean recomputation is cut in pieces (lean mode differs from full on them)
    wrapped_forward_kernels: float  # the kernels of those blocks' forward (counted in the same step)
    calls_by_kind: dict[str, int]


class _DeviceWorkCounter(WorkCounter):
    """:class:`WorkCounter`, with allocations and copies to host memory taken off the kernels; the latter's bytes
    counted as host-link bytes."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.link_bytes = 0
        self._host_storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        to_host = name == "copy_" and _storage_key(args[0]) in self._host_storages
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if allocating_on_host():
            self._host_storages.update(_storage_key(t) for t in _tensors(out))
        elif to_host or name in _ALLOCATIONS:
            self.counts[(self.context.phase, self.context.current_block)].kernels -= 1
            self.link_bytes += args[0].numel() * args[0].element_size() if to_host else 0
        return out


class _BlockContext:
    """The ``current_block`` a :class:`WorkCounter` reads: the block whose forward runs (hooks do not fire on a
    recomputation), else ``""``."""

    def __init__(self) -> None:
        self.phase = ""
        self.current_block = ""

    def follow(self, blocks: dict[str, nn.Module]) -> list[Any]:
        """Hooks on ``blocks`` that keep :attr:`current_block`; the handles, to remove them."""

        def enter(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                self.current_block = name

            return hook

        def leave(*_: Any) -> None:
            self.current_block = ""

        handles = []
        for name, block in blocks.items():
            handles.append(block.register_forward_pre_hook(enter(name)))
            handles.append(block.register_forward_hook(leave))
        return handles


@contextlib.contextmanager
def _hot_path_calls() -> Iterator[Counter[str]]:
    """Count the calls of Python dispatch modes of checkpointing and of saved-tensor hooks while the context runs."""
    calls: Counter[str] = Counter()
    original = torch.autograd.graph.saved_tensors_hooks.__init__

    def counted_hooks(self: Any, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        def counted_pack(tensor: Tensor) -> Any:
            calls["saved-tensor hooks"] += 1
            return pack(tensor)

        def counted_unpack(packed: Any) -> Tensor:
            calls["saved-tensor hooks"] += 1
            return unpack(packed)

        original(self, counted_pack, counted_unpack)

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call" and frame.f_code.co_name == "__torch_dispatch__":
            mode = frame.f_locals.get("self")
            if mode is not None and type(mode).__module__.startswith(_HOT_PATH_MODULES):
                calls["dispatch-mode ops"] += 1

    torch.autograd.graph.saved_tensors_hooks.__init__ = counted_hooks  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        torch.autograd.graph.saved_tensors_hooks.__init__ = original  # type: ignore[method-assign]


def count_step(case: Case, mode: str, loss_fn: Callable[[nn.Module, Any], Tensor] | None = None) -> StepWork:
    """Count one forward and backward of ``case`` with its blocks in ``mode`` (a key of :data:`MODES`), in fake mode.

    Example::

        >>> none, full = (count_step(REDUCED[0], mode) for mode in ("none", "full"))
        >>> none.wrapped, full.wrapped, full.flops / none.flops <= FULL_FLOPS_LIMIT
        (0, 4, True)
    """
    if mode not in MODES:
        raise ValueError(f"Unknown `mode`={mode!r}; valid choices: {', '.join(MODES)}")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    module = materialise(case.build, fake_mode)
    wrapped = _wrapped_blocks(module, mode)
    step = training_step_fn(module, loss_fn or _loss_of(case))
    context = _BlockContext()
    counter = _DeviceWorkCounter(context)
    handles = context.follow(wrapped[1])
    module.train()
    try:
        with fake_mode:
            batch = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, Tensor) else t, case.batch())
            with _hot_path_calls() as calls, counter:
                step(batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    total = counter.total()
    return StepWork(
        flops=total.flops,
        kernels=total.kernels,
        bytes_written=total.bytes_written,
        link_bytes=counter.link_bytes,
        python_calls=sum(calls.values()),
        wrapped=wrapped[0],
        cut=sum(_is_cut(block) for block in wrapped[1].values()),
        wrapped_forward_kernels=counter.total(blocks=tuple(wrapped[1])).kernels,
        calls_by_kind=dict(calls),
    )


def _wrapped_blocks(module: nn.Module, mode: str) -> tuple[int, dict[str, nn.Module]]:
    """Wrap ``module``'s blocks in ``mode``; how many it wrapped, and the blocks checkpointing wraps (by name)."""
    modules = dict(module.named_modules())
    blocks = checkpoint_modules(module, "auto").modules
    remove_activation_checkpointing(module)
    if MODES[mode] is not None:
        checkpoint_modules(module, MODES[mode])
    return (0 if MODES[mode] is None else len(blocks)), {name: modules[name] for name in blocks}


def _is_cut(block: nn.Module) -> bool:
    lean = lean_recompute(block)
    return lean is not None and lean.cut


def _loss_of(case: Case) -> Callable[[nn.Module, Any], Tensor] | None:
    if case.preset.startswith("vit"):
        return lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])
    return None


def _storage_key(tensor: Any) -> int:
    return tensor.untyped_storage()._cdata if isinstance(tensor, Tensor) else -1


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    return [t for t in out if isinstance(t, Tensor)] if isinstance(out, (tuple, list)) else []


def measure(cases: tuple[Case, ...]) -> list[dict[str, object]]:
    """One row per case and mode: the counts, each over none's, and the Python calls per wrapped block."""
    rows: list[dict[str, object]] = []
    for case in cases:
        none = count_step(case, "none")
        for mode in MODES:
            if mode == "lean" and not none.cut:
                continue
            work = none if mode == "none" else count_step(case, mode)
            rows.append(
                {
                    "case": case.name,
                    "mode": mode,
                    "flops": f"{work.flops:.6g}",
                    "kernels": int(work.kernels),
                    "bytes_written": f"{work.bytes_written:.6g}",
                    "link_bytes_each_way": int(work.link_bytes),
                    "python_calls": work.python_calls,
                    "wrapped_blocks": work.wrapped,
                    "flops_over_none": f"{work.flops / none.flops:.3f}",
                    "kernels_over_none": f"{work.kernels / none.kernels:.3f}",
                    "bytes_over_none": f"{work.bytes_written / none.bytes_written:.3f}",
                    "kernels_added": int(work.kernels - none.kernels),
                    "wrapped_forward_kernels": int(none.wrapped_forward_kernels),
                    "python_calls_per_block": f"{work.python_calls / work.wrapped:.1f}" if work.wrapped else "0",
                }
            )
            print(*rows[-1].values(), sep="  ", flush=True)
    return rows


def misses(rows: list[dict[str, str]]) -> list[str]:
    """The limits of issue 49 a row misses, one line each (none: every limit held)."""
    found = []
    by_case: dict[str, dict[str, dict[str, str]]] = {}
    for row in rows:
        by_case.setdefault(str(row["case"]), {})[str(row["mode"])] = row
    for case, modes in by_case.items():
        full, selective = modes["full"], modes["selective"]
        if float(full["flops_over_none"]) > FULL_FLOPS_LIMIT:
            found.append(f"{case}: full does {full['flops_over_none']}× none's FLOPs (limit {FULL_FLOPS_LIMIT})")
        if int(full["kernels_added"]) > int(full["wrapped_forward_kernels"]):
            found.append(
                f"{case}: full adds {full['kernels_added']} kernels, more than the wrapped blocks' forward "
                f"{full['wrapped_forward_kernels']}"
            )
        if float(selective["flops_over_none"]) > 1.0005:
            found.append(f"{case}: selective does {selective['flops_over_none']}× none's FLOPs (limit 1)")
        if int(selective["kernels"]) > int(full["kernels"]):
            found.append(f"{case}: selective launches {selective['kernels']} kernels, full {full['kernels']}")
        if float(selective["python_calls_per_block"]) > SELECTIVE_CALLS_LIMIT:
            found.append(
                f"{case}: selective makes {selective['python_calls_per_block']} Python calls per wrapped block "
                f"(limit {SELECTIVE_CALLS_LIMIT})"
            )
    return found


def table(path: Path) -> str:
    """The docs table: the counted ratios of each case and mode, beside the H200's measured step times."""
    measured = {(row["case"], row["variant"]): row["ratio_over_none"] for row in read_rows(_H200_TIMES)}
    lines = []
    for row in read_rows(path):
        if row["mode"] == "none":
            continue
        link = int(row["link_bytes_each_way"])
        lines.append(
            [
                row["case"],
                row["mode"],
                row["flops_over_none"],
                row["kernels_over_none"],
                f"{int(row['kernels_added'])} of {row['wrapped_forward_kernels']}",
                row["bytes_over_none"],
                f"{link / 2**30:.1f}" if link else "–",
                f"{row['python_calls']} ({row['python_calls_per_block']} a block)",
                measured.get((row["case"], row["mode"]), "–"),
            ]
        )
    columns = [
        "case",
        "mode",
        "FLOPs × none",
        "kernels × none",
        "kernels added of the blocks' forward",
        "bytes written × none",
        "host link GiB each way",
        "Python calls a step",
        "H200 time × none (measured, at 11b0cf0)",
    ]
    return markdown_table(columns, lines)


def main(argv: list[str] | None = None) -> int:
    parser = TableParser(__doc__, __file__, table)
    parser.add_argument("--reduced", action="store_true", help="the tiny presets, not the reference sizes")
    parser.add_argument("--check", action="store_true", help="exit 1 when a limit of issue 49 is missed")
    args = parser.parse_args(argv)
    rows = measure(REDUCED if args.reduced else REFERENCE)
    if not args.reduced:
        write_csv(args.csv, rows)
    found = misses([{key: str(value) for key, value in row.items()} for row in rows])
    for line in found:
        print("missed:", line)
    return 1 if args.check and found else 0


if __name__ == "__main__":
    raise SystemExit(main())
