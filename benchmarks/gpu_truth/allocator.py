"""gpu_truth.py's allocator rows: what the caching allocator reserves beyond the tensors, with and without
expandable segments (``memopt-train``'s default since it sets ``expandable_segments:True``).

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts: each setting runs two training steps
in a fresh process (this module run with ``-m``), which prints its peaks as JSON.

    cd benchmarks && python -m gpu_truth.allocator --suite quick --index 0 [--cpu]   # one child run

Example::

    >>> sorted(SETTINGS)
    ['default', 'expandable_segments:True']
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from .cases import SUITES
from .device import Peak, TruthDevice
from .rows import row

# the value of PYTORCH_CUDA_ALLOC_CONF in the child (None: unset, PyTorch's default)
SETTINGS = {"default": None, "expandable_segments:True": "expandable_segments:True"}
_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def child_peak(suite: str, index: int, on_cuda: bool, setting: str) -> Peak:
    """Two fp32 steps of the suite's margin case ``index`` in a fresh process under ``setting``."""
    environment = {key: value for key, value in os.environ.items() if key not in _VARIABLES}
    if SETTINGS[setting] is not None:
        environment["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[setting]
    command = [sys.executable, "-m", "gpu_truth.allocator", "--suite", suite, "--index", str(index)]
    done = subprocess.run(
        [*command, *([] if on_cuda else ["--cpu"])],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=Path(__file__).resolve().parents[1],  # benchmarks/: where the package is found
    )
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    return Peak(peaks["allocated"], peaks["reserved"])


def allocator_rows(device: TruthDevice, suite: str) -> list[dict]:
    """Reserved over allocated for the suite's first margin case (the smallest step: the most overhead), both ways."""
    case = SUITES[suite].margins[0]
    rows = []
    for setting in SETTINGS:
        peak = child_peak(suite, 0, device.is_cuda, setting)
        overhead = peak.reserved / peak.allocated if not math.isnan(peak.reserved) else math.nan
        note = "ratio: reserved / allocated" if device.is_cuda else "no caching allocator on the CPU: nothing reserved"
        rows.append(row("allocator", case.name, f"32-true, {setting}", peak=peak, ratio=overhead, note=note))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, choices=sorted(SUITES))
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--cpu", action="store_true", help="measure on the CPU (the dry run)")
    args = parser.parse_args()
    from .memory import measured_peak

    device = TruthDevice.detect(prefer_cuda=not args.cpu)
    peak, _ = measured_peak(device, SUITES[args.suite].margins[args.index], "32-true", None)
    print(json.dumps({"allocated": peak.allocated, "reserved": peak.reserved}))


if __name__ == "__main__":
    main()
