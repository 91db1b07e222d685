"""Two CPU ranks (gloo) fit under ActivationCheckpointing({"budget": 0.4}) pricing alike only on rank 0's word.

Rank 1 prices for a host link 2500× slower than rank 0's A100, so on its own it would recompute what rank 0
offloads: every rank applying rank 0's choice shows the choice was broadcast, not made again.

python tests/callbacks/checkpoint_budget_ddp_run.py OUT_DIR     # writes OUT_DIR/rank{0,1}.pt
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.callbacks import activation_checkpointing as callback_module
from lightning_memopt.planner import gpu, plan_checkpointing

sys.path.insert(0, str(Path(__file__).parents[1]))  # the test modules import `helpers` as pytest's rootdir does
from tests.callbacks.test_activation_checkpointing import TinyViTModule, _loader  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402


def rank_prices(device, name, budget):
    """An A100 (deterministic, not this CPU's timings) on rank 0; one with a 0.01 GB/s host link on rank 1."""
    a100 = gpu("a100_80gb")
    return a100 if torch.distributed.get_rank() == 0 else replace(a100, host_link_gbps=0.01)


def main(out_dir: str) -> None:
    callback_module.hardware_for = rank_prices
    callback = ActivationCheckpointing({"budget": 0.4})
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=2, callbacks=[callback])
    trainer.fit(TinyViTModule(), _loader())
    own = plan_checkpointing(TinyViTModule(), next(iter(_loader())), 0.4, hardware=rank_prices(None, None, None))
    result = {"chosen": dict(callback.chosen), "wrapped": dict(callback.report.modules), "own": own.modes}
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
