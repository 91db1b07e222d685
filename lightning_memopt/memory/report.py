"""Out-of-memory reports: what was live at the peak, and what to try, with estimated savings.

:func:`chart` is the one set-up for every chart the project draws: matplotlib off-screen, the figure laid
out, saved and closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_memopt.memory.tracker import MemorySnapshot
from lightning_memopt.vocabulary import GIB, format_bytes


def _gib(nbytes: float) -> str:
    return format_bytes(nbytes, digits=3, gib_from=2**27)


def suggestions(snapshot: MemorySnapshot, devices: int | None = None) -> list[tuple[str, int, str]]:
    """What to try, each as ``(remedy, estimated bytes saved, how the estimate was made)``, largest first.

    The estimates are first-order: they assume the step's shape stays as it was at the peak. ``devices``: how
    many the run has (sharding is proposed over those, or said to need more).

    Example::

        >>> suggestions(MemorySnapshot())
        []
    """
    totals = snapshot.by_category()
    activations = totals["activations"]
    fp32_activations = sum(
        r.nbytes for r in snapshot.records if r.category == "activations" and r.dtype == torch.float32
    )
    found = []
    checkpointing = _checkpointing(snapshot)
    if checkpointing is not None:
        found.append(checkpointing)
    if fp32_activations:
        found.append(
            (
                "bf16 mixed precision (precision=bf16_mixed)",
                fp32_activations // 2,
                "half of the activations now held in fp32",
            )
        )
    if activations or totals["inputs"]:
        found.append(
            (
                "halve the batch size and accumulate over 2 (data.batch_size=<half> "
                "trainer.accumulate_grad_batches=2; or AdaptiveAccumulation)",
                (activations + totals["inputs"]) // 2,
                "half of the activations and inputs; the effective batch is unchanged",
            )
        )
    state = totals["parameters"] + totals["gradients"] + totals["optimizer_state"]
    if state:
        found.append(_sharding(state, devices))
    return sorted(found, key=lambda item: -item[1])


def _checkpointing(snapshot: MemorySnapshot) -> tuple[str, int, str] | None:
    """Checkpointing the tracked blocks (one is recomputed live at a time), else the top-level modules."""
    by_block = snapshot.activations_by_block()
    if len(by_block) > 1:
        names = list(by_block)
        held = sum(by_block.values())
        return (
            f"activation checkpointing of its {len(names)} blocks ({_span(names)}; memopt=checkpointing, or the "
            "ActivationCheckpointing callback)",
            held - max(by_block.values()),
            "the blocks' activations less the largest block's, which is recomputed live in backward",
        )
    by_module = snapshot.activations_by_module()
    if len(by_module) > 1:  # activations there: by_module counts only them
        return (
            "activation checkpointing of the top-level modules (the ActivationCheckpointing callback)",
            sum(by_module.values()) - max(by_module.values()),
            "activations less the largest module's, which is recomputed live in backward",
        )
    return None


def _span(names: list[str]) -> str:
    """``"blocks.0 … blocks.23"`` in module order where the names are numbered; else the first few."""
    ordered = sorted(names, key=lambda name: [int(part) if part.isdigit() else part for part in name.split(".")])
    return f"{ordered[0]} … {ordered[-1]}" if len(ordered) > 2 else ", ".join(ordered)


def _sharding(state: int, devices: int | None) -> tuple[str, int, str]:
    if devices is not None and devices > 1:
        return (
            f"sharding parameters, gradients and optimizer state over the run's {devices} devices "
            "(strategy=fsdp_memopt)",
            state * (devices - 1) // devices,
            f"{devices - 1}/{devices} of parameters + gradients + optimizer state",
        )
    needs = "needs more devices than this run's 1" if devices == 1 else "needs 2 devices or more"
    return (
        f"sharding parameters, gradients and optimizer state (strategy=fsdp_memopt; {needs}; the estimate is for 2)",
        state // 2,
        "1/2 of parameters + gradients + optimizer state, over 2 devices",
    )


def top_rows(totals: dict[str, int], limit: int = 8) -> list[tuple[str, int]]:
    """The ``limit`` largest entries of ``totals``, the rest summed in one row (a ViT's 24 blocks stay readable).

    Example::

        >>> top_rows({"a": 5, "b": 3, "c": 2, "d": 1}, limit=2)
        [('a', 5), ('b', 3), ('2 more', 3)]
    """
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    if len(ranked) <= limit + 1:
        return ranked
    rest = ranked[limit:]
    return [*ranked[:limit], (f"{len(rest)} more", sum(nbytes for _, nbytes in rest))]


def format_report(snapshot: MemorySnapshot, title: str, largest: int = 15, devices: int | None = None) -> str:
    """A plain-text report of ``snapshot``: breakdown, top-level modules and blocks, largest tensors, remedies."""
    lines = [title, "", f"live at the peak: {_gib(snapshot.total_bytes)} (phase: {snapshot.phase})", ""]
    lines.append("by category:")
    lines += [f"  {name:<18}{_gib(nbytes):>14}" for name, nbytes in snapshot.by_category().items()]
    lines += ["", "activations by top-level module:"]
    lines += [f"  {name:<24}{_gib(nbytes):>14}" for name, nbytes in top_rows(snapshot.activations_by_module())]
    by_block = snapshot.activations_by_block()
    if by_block:
        lines += ["", f"activations by block ({len(by_block)} blocks, {_gib(sum(by_block.values())).strip()}):"]
        lines += [f"  {name:<24}{_gib(nbytes):>14}" for name, nbytes in top_rows(by_block)]
    lines += ["", f"largest {largest} tensors:"]
    for record in snapshot.largest(largest):
        where = record.block or record.module or "<root>"
        lines.append(
            f"  {_gib(record.nbytes):>14}  {record.category:<16} {record.op:<28} {list(record.shape)} "
            f"{str(record.dtype).replace('torch.', '')} in {where}"
        )
    lines += ["", "what to try (first-order estimates of the bytes saved at this peak):"]
    for remedy, saved, basis in suggestions(snapshot, devices):
        lines.append(f"  - {remedy}: ~{_gib(saved)} ({basis})")
    return "\n".join(lines) + "\n"


def write_timeline_chart(timeline: list[tuple[int, int, str]], path: Path, title: str) -> bool:
    """Plot live bytes over the events of a step to a PNG; False when matplotlib is not installed."""
    try:
        with chart(path, (9, 4)) as axes:
            for phase in sorted({phase for _, _, phase in timeline}):
                points = [(event, live / GIB) for event, live, p in timeline if p == phase]
                axes.scatter([e for e, _ in points], [g for _, g in points], s=4, label=phase)
            axes.set_xlabel("allocation / free event")
            axes.set_ylabel("live tensor memory (GiB)")
            axes.set_title(title)
            axes.legend(markerscale=3)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def chart(path: str | Path, size: tuple[float, float], dpi: int = 100) -> Iterator[Any]:
    """Yield the axes of a new figure of ``size`` inches; on leaving, write it to ``path`` as a PNG.

    matplotlib is imported here only (an optional dependency): ``ImportError`` when it is missing.
    The figure is closed whether or not drawing succeeded.

    Example::

        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "line.png"
        >>> with chart(path, (4, 3)) as axes:
        ...     _ = axes.plot([0, 1], [0, 1])
        >>> path.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=size)
    try:
        yield axes
        figure.tight_layout()
        figure.savefig(path, dpi=dpi)
    finally:
        plt.close(figure)
