"""One of two CPU ranks (gloo) under fsdp_memopt and AdaptiveAccumulation(micro_batch_size=8); rank FAIL_RANK runs
out of memory at step 1, in the forward or the backward pass of a micro-batch.

python tests/callbacks/adaptive_fsdp_oom_run.py forward_limit|backward_limit FAIL_RANK

Started once per rank with torchrun's variables (tests.helpers.run_ranks): no launcher ends the
other rank when one fails, so each must stop by itself.
"""

import sys

from lightning_memopt import AdaptiveAccumulation
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.callbacks.test_adaptive_accumulation import OOMToy
from tests.helpers import quiet_trainer


def main(fault: str, fail_rank: str) -> None:
    module = OOMToy(**{fault: 4}, fail_rank=int(fail_rank), fail_from=1)
    trainer = quiet_trainer(strategy=MemoptFSDPStrategy(), devices=2, max_steps=3, limit_val_batches=0,
                            callbacks=[AdaptiveAccumulation(micro_batch_size=8)])  # fmt: skip
    trainer.fit(module)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
