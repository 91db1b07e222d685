"""TopoFR's topological loss, forward + backward: ours (B × B distances, device MST) vs the broadcast formulation.

    python benchmarks/claims/topo_loss.py [--batches 32 64 128] [--rounds 3]

Inputs are a batch of 3 × 112 × 112 images and its 512-d embeddings, as in TopoFR on IResNet.
- "broadcast" is the reference formulation, written here: distances from ``x[:, None] − x``
  (a ``B × B × D`` tensor, for the images and the embeddings), copied to the host for a Kruskal
  union–find in Python over numpy-sorted edges, TopoFR's diagram loss, and
  ``backward(retain_graph=True)``.
- "ours" is :class:`~lightning_memopt.losses.TopologicalAlignmentLoss` (the same loss value).
Memory: the peak of tensors allocated during one forward + backward (inputs excluded), counted by
the project's tracker. Time: the two alternate round by round in one process on the CPU; medians.
Targets at B = 128: peak ≥ 50× lower, and not slower. Writes topo_loss.csv.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

from lightning_memopt.losses import TopologicalAlignmentLoss
from lightning_memopt.memory import MemoryTracker

MEMORY_TARGET = 50.0


def broadcast_distances(points: torch.Tensor) -> torch.Tensor:
    flat = points.reshape(points.shape[0], -1)
    return (flat[:, None] - flat).norm(dim=2)  # B × B × D before the norm


def host_kruskal(distances: torch.Tensor) -> torch.Tensor:
    """Minimum-spanning-tree edges, in Kruskal order, from a copy on the host."""
    matrix = distances.detach().cpu().numpy()
    rows, cols = np.triu_indices(matrix.shape[0], k=1)
    order = np.argsort(matrix[rows, cols], kind="stable")
    parent = list(range(matrix.shape[0]))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    edges = []
    for index in order:
        a, b = root(int(rows[index])), root(int(cols[index]))
        if a != b:
            parent[a] = b
            edges.append((rows[index], cols[index]))
    return torch.tensor(np.array(edges), dtype=torch.long, device=distances.device)


def broadcast_loss(images: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    input_distances, latent_distances = broadcast_distances(images), broadcast_distances(embeddings)
    input_edges, latent_edges = host_kruskal(input_distances), host_kruskal(latent_distances)
    target = input_distances[input_edges[:, 0], input_edges[:, 1]].detach()
    latent = latent_distances[latent_edges[:, 0], latent_edges[:, 1]]
    return (target - latent).pow(2).sum() / images.shape[0]


def step(loss_fn: Callable, images: torch.Tensor, embeddings: torch.Tensor, retain_graph: bool) -> float:
    embeddings.grad = None
    loss = loss_fn(images, embeddings)
    loss.backward(retain_graph=retain_graph)
    return float(loss.detach())


def table(path: Path) -> str:
    """The docs' table from the CSV: peak and time per batch size, the largest batch (the target's) in bold."""
    rows = read_rows(path)
    lines = []
    for row in rows:
        bold = "**" if row is rows[-1] else ""
        lines.append(
            [
                row["batch"],
                f"{float(row['broadcast_peak_mib']):,.1f} MiB",
                f"{float(row['ours_peak_mib']):.3f} MiB",
                f"{bold}{float(row['memory_ratio']):,.0f}×{bold}",
                f"{float(row['broadcast_s']) * 1000:,.1f} ms",
                f"{float(row['ours_s']) * 1000:,.1f} ms",
                f"{bold}{float(row['time_ratio']):.2f}{bold}",
            ]
        )
    columns = ["B", "broadcast peak", "ours peak", "lower by", "broadcast time", "ours time", "ours / broadcast"]
    return markdown_table(columns, lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table, rounds=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    args = parser.parse_args()
    ours_loss = TopologicalAlignmentLoss("diagram")
    variants = {"broadcast": (broadcast_loss, True), "ours": (ours_loss, False)}
    rows = []
    for batch in args.batches:
        generator = torch.Generator().manual_seed(batch)
        images = torch.rand(batch, 3, 112, 112, generator=generator) * 2 - 1
        embeddings = torch.randn(batch, 512, generator=generator).requires_grad_()
        peaks, values, times = {}, {}, {name: [] for name in variants}
        for name, (loss_fn, retain) in variants.items():
            tracker = MemoryTracker()
            with tracker:
                values[name] = step(loss_fn, images, embeddings, retain)
            peaks[name] = tracker.peak.total_bytes - images.numel() * 4  # the tracker meets the images in the loss
        for _ in range(args.rounds):
            for name, (loss_fn, retain) in variants.items():
                start = time.perf_counter()
                step(loss_fn, images, embeddings, retain)
                times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(samples) for name, samples in times.items()}
        row = {
            "batch": batch,
            "broadcast_peak_mib": peaks["broadcast"] / 2**20,
            "ours_peak_mib": peaks["ours"] / 2**20,
            "memory_ratio": peaks["broadcast"] / peaks["ours"],
            "broadcast_s": median["broadcast"],
            "ours_s": median["ours"],
            "time_ratio": median["ours"] / median["broadcast"],
            "loss_broadcast": values["broadcast"],
            "loss_ours": values["ours"],
        }
        rows.append(row)
        print(
            f"B={batch}: peak {row['broadcast_peak_mib']:.1f} MiB vs ours {row['ours_peak_mib']:.3f} MiB "
            f"= {row['memory_ratio']:.0f}× lower; "
            f"time {row['broadcast_s'] * 1e3:.1f} ms vs {row['ours_s'] * 1e3:.1f} ms "
            f"(ours / broadcast {row['time_ratio']:.3f}); loss {values['broadcast']:.6g} vs {values['ours']:.6g}; "
            f"all times broadcast {[round(t * 1e3, 1) for t in times['broadcast']]} "
            f"ours {[round(t * 1e3, 1) for t in times['ours']]} ms"
        )
    last = rows[-1]
    memory_met = "met" if last["memory_ratio"] >= MEMORY_TARGET else "MISSED"
    time_met = "met" if last["time_ratio"] <= 1.0 else "MISSED"
    print(
        f"B={last['batch']}: memory {last['memory_ratio']:.0f}× lower (target ≥ {MEMORY_TARGET:.0f}×: {memory_met}); "
        f"time ratio {last['time_ratio']:.3f} (target ≤ 1, not slower: {time_met})"
    )
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
