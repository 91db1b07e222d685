"""Archived, runnable only inside a checkout of commit 11b0cf0: the kernels and offloaded bytes of the
implementation the H200 measured, counted by that implementation itself.

The H200's step times (``gpu_truth_h200.csv``, ``step_time_compute_bound_h200.csv``) were measured on main at
11b0cf0, whose checkpointing launched other kernels than today's (a clone of every batch-norm buffer per call,
PyTorch's selective contexts, a Sapiens head recomputed in 32 row tiles with a gradient call per tile) and
offloaded every saved tensor. ``calibration/cost_model_h200.py`` prices that implementation's steps from these
counts. Each case is profiled in fake mode by the checkout the script runs in (its own ``lightning_memopt`` and
``truth_cases``; about 40 s), so run it inside a checkout of that commit::

    git worktree add /tmp/h200-tree 11b0cf0     # from the repository root
    cd /tmp/h200-tree && python "$OLDPWD/benchmarks/calibration/archive/h200_implementation_work.py" \\
        --csv "$OLDPWD/benchmarks/calibration/archive/h200_implementation_work.csv"

It imports that tree's own ``benchmarks/truth_cases.py`` (today's ``benchmarks/gpu_truth/cases.py``), so today's
checkout cannot run it; ``h200_implementation_work.csv`` beside it is what it counted there.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

TREE = Path.cwd()
sys.path[:0] = [str(TREE), str(TREE / "benchmarks")]  # the checkout's own package and cases, not the installed ones

import torch  # noqa: E402
from truth_cases import face, normals, tracking  # noqa: E402

from lightning_memopt.checkpointing import checkpoint_modules  # noqa: E402
from lightning_memopt.memory import profile_step  # noqa: E402

# cost_model_h200's cases and policies (its rows name them)
CASES = (
    face("r100", 128),
    normals("sapiens_0.3b", 2, 1024, 768),
    face("r50", 32),
    normals("sapiens_0.3b", 1, 512, 384),
    tracking("cotracker3", 16, 256, 384, 512),
)
POLICIES = {"none": None, "selective": "selective", "full": "preset", "offload": "offload"}


def counted(case, policy) -> dict[str, float]:  # noqa: ANN001 (either checkout's Case)
    """One forward and backward of ``case`` under ``policy`` in fake mode: its kernels and offloaded bytes."""
    prepare = None if policy is None else (lambda model: checkpoint_modules(model, policy))
    profile = profile_step(
        case.build,
        case.batch(),
        mode="fake",
        steps=1,
        prepare_model=prepare,
        optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.0),
    )
    return {"kernels": profile.work(("forward", "backward")).kernels, "offloaded_bytes": profile.offloaded_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True)
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=TREE, capture_output=True, text=True).stdout
    rows = []
    for case in CASES:
        for variant, policy in POLICIES.items():
            rows.append({"case": case.name, "variant": variant, **counted(case, policy), "commit": commit.strip()})
            print(*rows[-1].values(), sep="  ", flush=True)
    with Path(args.csv).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
