"""Two CPU ranks (gloo) train the Toy model under PrecisionSwitch; only rank 1 sees a NaN loss, at steps 1 and 2.

python tests/callbacks/precision_ddp_run.py OUT_DIR     # writes OUT_DIR/rank{0,1}.pt
"""

import sys

import torch

from lightning_memopt import PrecisionSwitch
from tests.callbacks.test_precision_switch import Toy
from tests.helpers import quiet_trainer


def nan_loss_on_rank_1(step: int, rank: int) -> str | None:
    return "nan_loss" if rank == 1 and step in (1, 2) else None


def main(out_dir: str) -> None:
    module = Toy(faults=nan_loss_on_rank_1)
    switch = PrecisionSwitch("bf16-mixed", fail_safe=True, patience=2)
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=5, callbacks=[switch])
    trainer.fit(module)
    plugin = trainer.strategy.precision_plugin
    result = {
        "history": plugin.history,
        "skipped_steps": plugin.skipped_steps,
        "precision": plugin.precision,
        "dtypes": module.dtypes(),
        "params": [p.detach().clone() for p in module.parameters()],
    }
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
