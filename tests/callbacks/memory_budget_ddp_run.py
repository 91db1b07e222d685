"""Two CPU ranks (gloo) fit under MemoryBudget: rank 0 plans, both apply its knobs (or both raise its error).

python tests/callbacks/memory_budget_ddp_run.py OUT_DIR BUDGET_MIB     # writes OUT_DIR/rank{0,1}.pt
"""

import sys

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryBudget
from tests.callbacks.test_memory_budget import _loader, _module
from tests.helpers import quiet_trainer


def main(out_dir: str, budget_mib: float) -> None:
    budget = MemoryBudget(budget=budget_mib / 1024)
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=2, callbacks=[budget])
    module = _module()
    try:
        trainer.fit(module, train_dataloaders=_loader())
        result = {
            "knobs": budget.knobs.as_dict(),
            "planned_here": budget.plan is not None,
            "applied": sorted(type(c).__name__ for c in budget.applied),
            "params": [p.detach().clone() for p in module.parameters()],
        }
    except MisconfigurationException as error:
        result = {"error": str(error)}
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
