"""The GPU-truth harness: every memory and time claim re-measured on a CUDA device, in one command.

    python benchmarks/gpu_truth.py [--quick | --dry-run] [--deadline SECONDS] [--csv PATH] [--table]

:mod:`~gpu_truth.harness` runs the sections in order and writes one CSV and one markdown table; each section is a
module here (:mod:`~gpu_truth.memory`, :mod:`~gpu_truth.runtime`, :mod:`~gpu_truth.host`, ...), the cases they
measure are :mod:`~gpu_truth.cases`, the device :mod:`~gpu_truth.device`, the rows :mod:`~gpu_truth.rows`.
``gpu_truth_h100.csv`` is the H100's run (2026-11-27); the H200's first run is ``calibration/gpu_truth_h200.csv``.
"""
