"""Out-of-memory reports: what was live at the peak, and what to try, with estimated savings."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_memopt.memory.chart import chart
from lightning_memopt.memory.tracker import MemorySnapshot
from lightning_memopt.vocabulary import GIB, format_bytes


def _gib(nbytes: float) -> str:
    return format_bytes(nbytes, digits=3, gib_from=2**27)


def suggestions(snapshot: MemorySnapshot) -> list[tuple[str, int, str]]:
    """What to try, each as ``(remedy, estimated bytes saved, how the estimate was made)``, largest first.

    The estimates are first-order: they assume the step's shape stays as it was at the peak.

    Example::

        >>> suggestions(MemorySnapshot())
        []
    """
    totals = snapshot.by_category()
    activations = totals["activations"]
    by_module = snapshot.activations_by_module()
    fp32_activations = sum(
        r.nbytes for r in snapshot.records if r.category == "activations" and r.dtype == torch.float32
    )
    found = []
    if activations and len(by_module) > 1:
        kept = max(by_module.values())
        found.append(
            (
                "activation checkpointing of the top-level blocks",
                activations - kept,
                "activations less the largest block's, which is recomputed live in backward",
            )
        )
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
                "micro-batches of half the batch, accumulated over 2 (trainer.accumulate_grad_batches=2)",
                (activations + totals["inputs"]) // 2,
                "half of the activations and inputs; the effective batch is unchanged",
            )
        )
    state = totals["parameters"] + totals["gradients"] + totals["optimizer_state"]
    if state:
        found.append(
            (
                "sharding parameters, gradients and optimizer state over 8 GPUs (strategy=fsdp)",
                state * 7 // 8,
                "7/8 of parameters + gradients + optimizer state",
            )
        )
    return sorted(found, key=lambda item: -item[1])


def format_report(snapshot: MemorySnapshot, title: str, largest: int = 15) -> str:
    """A plain-text report of ``snapshot``: breakdown, top-level modules, largest tensors, remedies."""
    lines = [title, "", f"live at the peak: {_gib(snapshot.total_bytes)} (phase: {snapshot.phase})", ""]
    lines.append("by category:")
    lines += [f"  {name:<18}{_gib(nbytes):>14}" for name, nbytes in snapshot.by_category().items()]
    lines += ["", "activations by top-level module:"]
    lines += [f"  {name:<24}{_gib(nbytes):>14}" for name, nbytes in snapshot.activations_by_module().items()]
    lines += ["", f"largest {largest} tensors:"]
    for record in snapshot.largest(largest):
        where = record.module or "<root>"
        lines.append(
            f"  {_gib(record.nbytes):>14}  {record.category:<16} {record.op:<28} {list(record.shape)} "
            f"{str(record.dtype).replace('torch.', '')} in {where}"
        )
    lines += ["", "what to try (first-order estimates of the bytes saved at this peak):"]
    for remedy, saved, basis in suggestions(snapshot):
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
