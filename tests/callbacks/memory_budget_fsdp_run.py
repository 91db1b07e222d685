"""CPU ranks (gloo) fit under fsdp_memopt with MemoryBudget: it plans for the sharding and sets the strategy's offload.

python tests/callbacks/memory_budget_fsdp_run.py OUT_DIR BUDGET_MIB DEVICES     # writes OUT_DIR/rank{0,…}.pt
"""

import sys

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryBudget
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.callbacks.test_memory_budget import _loader, _module
from tests.helpers import quiet_trainer


def main(out_dir: str, budget_mib: float, devices: int) -> None:
    # the catalogue's rates: fewer profiles; the margin the test's budgets were sized for
    budget = MemoryBudget(budget=budget_mib / 1024, gpu="a100_80gb", safety_margin=0.1)
    strategy = MemoptFSDPStrategy()
    trainer = quiet_trainer(strategy=strategy, devices=devices, max_steps=2, callbacks=[budget])
    module = _module()
    try:
        trainer.fit(module, train_dataloaders=_loader())
        result = {
            "knobs": budget.knobs.as_dict(),
            "planned_here": budget.plan is not None,
            "cpu_offload": strategy.cpu_offload,
            "param_dtype": strategy.param_dtype,
            "steps": trainer.global_step,
            "local_elements": sum(p.to_local().numel() for p in module.parameters()),
            "elements": sum(p.numel() for p in module.parameters()),
        }
    except MisconfigurationException as error:
        result = {"error": str(error)}
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
