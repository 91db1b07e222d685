"""Two CPU ranks (gloo) fit under MemoryBudget: rank 0 plans, both apply its knobs (or both raise its error).

python tests/callbacks/memory_budget_ddp_run.py OUT_DIR BUDGET_MIB [RANK1_DEVICE_MIB]   # writes OUT_DIR/rank{0,1}.pt

With RANK1_DEVICE_MIB the plan is measured on both ranks, rank 1's trials on a simulated device of that many MiB
(what its trial steps allocate counts; the copy of the model does not): a trial may run out of memory there alone.
"""

import os
import sys

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryBudget
from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.planner import trials
from tests.callbacks.test_memory_budget import _loader, _module
from tests.helpers import quiet_trainer


def _simulate_a_smaller_device(mib: float) -> None:
    run = trials._Trial.run

    def on_the_smaller_device(self, steps):
        with SimulatedDevice(int(mib * 2**20)):
            return run(self, steps)

    trials._Trial.run = on_the_smaller_device


def main(out_dir: str, budget_mib: float, rank1_device_mib: float | None) -> None:
    measure = rank1_device_mib is not None
    if measure and os.environ.get("LOCAL_RANK", "0") == "1":
        _simulate_a_smaller_device(rank1_device_mib)
    budget = MemoryBudget(budget=budget_mib / 1024, measure="refresh" if measure else False)
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=2, callbacks=[budget])
    module = _module()
    try:
        trainer.fit(module, train_dataloaders=_loader())
        result = {
            "knobs": budget.knobs.as_dict(),
            "planned_here": budget.plan is not None,
            "applied": sorted(type(c).__name__ for c in budget.applied),
            "params": [p.detach().clone() for p in module.parameters()],
            "measured": []
            if budget.plan is None
            else [(m.knobs.as_dict(), m.outcome) for m in budget.plan.measurements],
        }
    except MisconfigurationException as error:
        result = {"error": str(error)}
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else None)
