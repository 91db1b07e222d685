"""One rank (started like torchrun's) of PowerSGD DDP fits, noting at exit whether a process group is still alive.

python tests/strategies/exit_run.py OUT_DIR FITS     # writes OUT_DIR/exit{rank}.txt as the interpreter exits
"""

import atexit
import os
import sys
from pathlib import Path

import torch.distributed as dist

from lightning_memopt.strategies import MemoptDDPStrategy
from tests.strategies.strategies_ddp_run import fit


def note_process_group(path: Path) -> None:
    """Registered before the first fit, so it runs after every handler the fits register (atexit runs LIFO)."""
    path.write_text(f"initialized={dist.is_initialized()}")


if __name__ == "__main__":
    out_dir, fits = Path(sys.argv[1]), int(sys.argv[2])
    atexit.register(note_process_group, out_dir / f"exit{os.environ['RANK']}.txt")
    for _ in range(fits):
        fit(MemoptDDPStrategy(comm_hook="powersgd", powersgd_warmup=2), 4)
