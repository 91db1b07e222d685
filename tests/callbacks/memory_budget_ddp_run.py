"""Two CPU ranks (gloo) fit under MemoryBudget: rank 0 plans, both apply its knobs (or both raise its error).

python tests/callbacks/memory_budget_ddp_run.py OUT_DIR BUDGET_MIB [measure | KNOBS_JSON]  # writes OUT_DIR/rank{0,1}.pt

With ``measure`` the plan is measured on both ranks, and rank 1 runs its first trial on a simulated device of one
byte: that trial runs out of memory there alone. With ``KNOBS_JSON`` (a mapping) those knobs are given, not planned.
"""

import json
import os
import sys

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryBudget
from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.planner import trials
from tests.callbacks.test_memory_budget import _loader, _module
from tests.helpers import quiet_trainer


def _first_trial_out_of_memory() -> None:
    run, tried = trials.Trial.run, []

    def first_on_a_full_device(self, steps):
        tried.append(self.knobs)
        if len(tried) > 1:
            return run(self, steps)
        with SimulatedDevice(1):
            return run(self, steps)

    trials.Trial.run = first_on_a_full_device


def main(out_dir: str, budget_mib: float, how: list[str]) -> None:
    measure = how == ["measure"]
    if measure and os.environ.get("LOCAL_RANK", "0") == "1":
        _first_trial_out_of_memory()
    if how and not measure:
        budget = MemoryBudget(knobs=json.loads(how[0]))
    else:
        budget = MemoryBudget(budget=budget_mib / 1024, measure="refresh" if measure else False, measure_candidates=12)
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=2, callbacks=[budget])
    torch.manual_seed(0)  # the same weights in every run (DDP gives rank 0's to every rank)
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
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
