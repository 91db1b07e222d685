"""Two CPU ranks (gloo) under AdaptiveAccumulation; only rank 1 runs out of memory, past 4 samples.

python tests/callbacks/adaptive_ddp_run.py OUT_DIR forward_limit|backward_limit   # writes OUT_DIR/rank{0,1}.pt

Each rank first trains without the callback (the reference), then with it and the failures; both runs see
the same data, so equal parameters mean the micro-batches' gradients were all-reduced like DDP's own.
"""

import sys

import torch

from lightning_memopt import AdaptiveAccumulation
from tests.callbacks.test_adaptive_accumulation import OOMToy
from tests.helpers import quiet_trainer


def train(module, callbacks):
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=4, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(module)
    return trainer


def main(out_dir: str, fault: str) -> None:
    reference = OOMToy()
    train(reference, [])
    module, callback = OOMToy(**{fault: 4}, fail_rank=1), AdaptiveAccumulation()
    sizes, micro_batches = [], []

    def record(*args):
        sizes.append(callback.last_micro_batch_size)
        micro_batches.append(callback.last_micro_batches)

    module.on_train_batch_end = record
    trainer = train(module, [callback])
    result = {
        "sizes": sizes,
        "micro_batches": micro_batches,
        "recoveries": callback.sizer.oom_recoveries,
        "params": [p.detach().clone() for p in module.parameters()],
        "reference": [p.detach().clone() for p in reference.parameters()],
    }
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
