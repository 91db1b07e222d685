"""Run the GPU-truth harness (the package ``gpu_truth/`` beside this file): ``python benchmarks/gpu_truth.py --help``.

python benchmarks/gpu_truth.py            # every preset on a CUDA device → gpu_truth/gpu_truth.csv
python benchmarks/gpu_truth.py --dry-run  # the tiny presets on the CPU: the same code path (what CI runs)
"""

import sys

from gpu_truth.harness import main  # the package gpu_truth/, which Python prefers to this file of the same name

if __name__ == "__main__":
    sys.exit(main())
