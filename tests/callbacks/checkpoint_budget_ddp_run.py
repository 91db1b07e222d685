"""Two CPU ranks (gloo) fit under ActivationCheckpointing({"budget": 0.5}): rank 0 chooses, both apply its choice.

python tests/callbacks/checkpoint_budget_ddp_run.py OUT_DIR     # writes OUT_DIR/rank{0,1}.pt
"""

import sys
from pathlib import Path

import torch

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.callbacks import activation_checkpointing as callback_module
from lightning_memopt.planner import gpu

sys.path.insert(0, str(Path(__file__).parents[1]))  # the test modules import `helpers` as pytest's rootdir does
from tests.callbacks.test_activation_checkpointing import TinyViTModule, _loader  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402


def main(out_dir: str) -> None:
    # priced as an A100 would be (deterministic, not this CPU's timings)
    callback_module.hardware_for = lambda device, name, budget: gpu("a100_80gb")
    callback = ActivationCheckpointing({"budget": 0.5})
    trainer = quiet_trainer(strategy="ddp", devices=2, max_steps=2, callbacks=[callback])
    module = TinyViTModule()
    trainer.fit(module, _loader())
    result = {
        "chosen": dict(callback.chosen),
        "wrapped": dict(callback.report.modules),
        "params": [p.detach().clone() for p in module.parameters()],
    }
    torch.save(result, f"{out_dir}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
