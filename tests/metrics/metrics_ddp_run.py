"""Two CPU ranks (gloo) each update KNNRetrieval / FaceVerification with their shard; both compute.

python tests/metrics/metrics_ddp_run.py OUT_DIR      # writes OUT_DIR/rank{0,1}.pt
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler

from lightning_memopt.metrics import FaceVerification, KNNRetrieval
from tests.metrics.test_retrieval_metrics import clustered


def run(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    embeddings, labels = clustered(samples=301)
    shard = slice(0, 151) if rank == 0 else slice(151, 301)
    retrieval = KNNRetrieval(chunk_size=40)
    retrieval.update(embeddings[shard], labels[shard])
    separate = KNNRetrieval()
    queries = slice(0, 51) if rank == 0 else slice(51, 101)
    references = slice(101, 201) if rank == 0 else slice(201, 301)
    separate.update(embeddings[queries], labels[queries])
    separate.update(embeddings[references], labels[references], reference=True)
    verification = FaceVerification(folds=5, far_targets=(0.1,))
    pairs = torch.arange(rank, 300, 2)
    verification.update(embeddings[pairs], embeddings[(pairs + 7) % 301], first_labels=labels[pairs],
                        second_labels=labels[(pairs + 7) % 301], pair_indices=pairs)  # fmt: skip
    result = {"retrieval": retrieval.compute(), "separate": separate.compute(), "verification": verification.compute()}
    padded = KNNRetrieval(chunk_size=32)  # Lightning's sampler: 151 per rank, index 0 repeated on rank 1
    order = torch.tensor(list(DistributedSampler(range(301), num_replicas=2, rank=rank, shuffle=False)))
    for batch in order.split(64):
        padded.update(embeddings[batch], labels[batch], indices=batch)
    lonely = KNNRetrieval()  # rank 1 saw no batch
    if rank == 0:
        lonely.update(embeddings[:151], labels[:151])
    one_sided = KNNRetrieval()  # queries on both ranks, references on rank 0 only
    one_sided.update(embeddings[queries], labels[queries])
    if rank == 0:
        one_sided.update(embeddings[101:], labels[101:], reference=True)
    mixed = KNNRetrieval()  # indices on rank 0 only: both ranks must raise, neither may wait
    mixed.update(embeddings[shard], labels[shard], indices=torch.arange(301)[shard] if rank == 0 else None)
    try:
        mixed.compute()
    except ValueError as error:
        result["mixed"] = str(error)
    lonely_pairs = FaceVerification(folds=5, far_targets=(0.1,))  # rank 1 saw no pair
    if rank == 0:
        lonely_pairs.update(embeddings[pairs], embeddings[(pairs + 7) % 301], first_labels=labels[pairs],
                            second_labels=labels[(pairs + 7) % 301], pair_indices=pairs)  # fmt: skip
    result.update(padded=padded.compute(), lonely=lonely.compute(), one_sided=one_sided.compute())
    result["lonely_pairs"] = lonely_pairs.compute()
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], 29000 + os.getpid() % 1000), nprocs=2)
