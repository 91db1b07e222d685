"""Exact kNN for retrieval evaluation: our chunked search vs the full N × N matrix and vs faiss-cpu.

    python benchmarks/claims/knn_eval.py [--samples 100000] [--dim 512] [--k 100] [--rounds 2]

N clustered embeddings are both queries and references (self excluded), as in validation.
- memory: the extra bytes of ``knn`` (its default: 1 GiB of scores per chunk) at its peak, counted by the
  project's tracker over the first chunks, against the ``N × N`` fp32 matrix of a one-shot search.
  Target ≤ 1/20.
- time: ``knn`` over all N queries vs faiss-cpu ``IndexFlatIP`` exact search (k + 1, self dropped),
  on the same normalised embeddings and the same threads, interleaved round by round; the fastest
  of ``--rounds`` each. Target ≤ 1.5×.
The neighbours must agree (ties aside, which random data does not have).
Writes knn_eval.csv.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tools and the wings
from bench import TableParser, markdown_table, read_rows, write_csv

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.metrics.functional.knn import DEFAULT_MEMORY, chunk_rows, knn

MEMORY_TARGET = 1 / 20
TIME_TARGET = 1.5


def embeddings(samples: int, dim: int, classes: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dim, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    points = centres[labels] + 2.0 * torch.randn(samples, dim, generator=generator)
    return points / points.norm(dim=1, keepdim=True)


def ours(points: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    _, indices = knn(points, points, k, exclude_self=True)
    return time.perf_counter() - start, indices


def theirs(points: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    import faiss

    start = time.perf_counter()
    index = faiss.IndexFlatIP(points.shape[1])
    index.add(points.numpy())
    _, found = index.search(points.numpy(), k + 1)
    indices = torch.from_numpy(found)
    keep = indices != torch.arange(points.shape[0])[:, None]
    keep[keep.all(dim=1), -1] = False
    indices = indices[keep].view(-1, k)
    return time.perf_counter() - start, indices


def table(path: Path) -> str:
    """The docs' table from the CSV: memory against the N × N matrix, time against faiss, agreement."""
    row = read_rows(path)[0]
    met = {"True": "met", "False": "missed"}
    ratio = float(row["memory_ratio"])
    pairs = int(row["samples"]) * int(row["k"])
    lines = [
        [
            "peak extra memory vs the N × N fp32 matrix",
            f"{float(row['peak_extra_mib']):.1f} MiB vs {float(row['full_matrix_gib']):.1f} GiB "
            f"= **1/{1 / ratio:.0f}**",
            f"≤ 1/{1 / MEMORY_TARGET:.0f}: {met[row['meets_memory_target']]}",
        ],
        [
            "time, ours / faiss `IndexFlatIP`",
            f"{float(row['ours_seconds']):.1f} s / {float(row['faiss_seconds']):.1f} s = "
            f"**{float(row['time_ratio']):.2f}**",
            f"≤ {TIME_TARGET:g}: {met[row['meets_time_target']]}",
        ],
        ["same neighbours as faiss", f"{float(row['neighbour_agreement']):.4%} of the {pairs:,}", "—"],
    ]
    return markdown_table(["figure", "measured", "target"], lines)


def main() -> None:
    parser = TableParser(__doc__, __file__, table, samples=100_000, dim=512, k=100, rounds=2)
    args = parser.parse_args()
    import faiss

    faiss.omp_set_num_threads(torch.get_num_threads())
    points = embeddings(args.samples, args.dim)

    chunk = chunk_rows(args.samples, args.k, DEFAULT_MEMORY)
    tracker = MemoryTracker()
    with tracker:  # two of the run's chunks, against every reference: the peak of one chunk
        knn(points[: 2 * chunk], points, args.k)
    extra = tracker.peak.total_bytes
    full = args.samples * args.samples * 4
    print(f"N={args.samples} D={args.dim} k={args.k}: peak extra {extra / 2**20:.1f} MiB vs N×N {full / 2**30:.1f} GiB")

    seconds: dict[str, list[float]] = {"ours": [], "faiss": []}
    found: dict[str, torch.Tensor] = {}
    for round_index in range(args.rounds):
        for name in ("ours", "faiss") if round_index % 2 == 0 else ("faiss", "ours"):
            elapsed, found[name] = (ours if name == "ours" else theirs)(points, args.k)
            seconds[name].append(elapsed)
            print(f"round {round_index}: {name} {elapsed:.1f} s")
    agreement = float((found["ours"] == found["faiss"]).double().mean())
    fastest = {name: min(values) for name, values in seconds.items()}
    row = {
        "samples": args.samples,
        "dim": args.dim,
        "k": args.k,
        "chunk": chunk,
        "threads": torch.get_num_threads(),
        "peak_extra_mib": extra / 2**20,
        "full_matrix_gib": full / 2**30,
        "memory_ratio": extra / full,
        "meets_memory_target": extra / full <= MEMORY_TARGET,
        "ours_seconds": fastest["ours"],
        "faiss_seconds": fastest["faiss"],
        "time_ratio": fastest["ours"] / fastest["faiss"],
        "meets_time_target": fastest["ours"] / fastest["faiss"] <= TIME_TARGET,
        "neighbour_agreement": agreement,
        "rounds": args.rounds,
    }
    print(
        f"memory: {extra / 2**20:.1f} MiB = 1/{full / extra:.0f} of N×N (target ≤ 1/20: "
        f"{'met' if row['meets_memory_target'] else 'MISSED'})\n"
        f"time: ours {fastest['ours']:.1f} s, faiss IndexFlatIP {fastest['faiss']:.1f} s, "
        f"ratio {row['time_ratio']:.2f} "
        f"(target ≤ {TIME_TARGET}: {'met' if row['meets_time_target'] else 'MISSED'}); neighbours agree {agreement:.4%}"
    )
    write_csv(args.csv, [row])


if __name__ == "__main__":
    main()
