"""gpu_truth.py's host rows: what checkpointing costs the host beside this device, against the planner's price.

The planner prices a host-bound step from the host costs of :mod:`lightning_memopt.planner.host` (its narrow
models, measured on the CPU that plans) and the device's host time per kernel. Here the same narrow models run on
the device (tiny kernels: the host sets the step's time) and on this machine's CPU, each mode over none, beside
the ratio the planner prices for this device. Then r50's narrow twin (``host_twin.py``: the H200's host-bound r50 case,
the implementation it measured) on the device and on this machine's CPU, its time per kernel beside the CI
machine's: how much slower or faster this host runs the same network's step. The last row sets this machine's CPU
beside the catalogue's host costs (measured on the project's 2-core CI machine): how much faster or slower its Python
is in the wrapped blocks.

Example::

    >>> from gpu_truth.device import TruthDevice
    >>> rows = host_rows(TruthDevice.detect(prefer_cuda=False), rounds=1)
    >>> sorted({row["case"] for row in rows})
    ['cnn', 'r50 twin', 'this host', 'transformer']
"""

from __future__ import annotations

from pathlib import Path

from bench import read_rows
from calibration.host_twin import PER_KERNEL, then_kernels, twin_seconds
from host_steps import WRAPPERS, narrow_region, priced_host_ratios

from lightning_memopt.planner.hardware import HOST_REGION_SECONDS
from lightning_memopt.planner.host import (
    NARROW_MODELS,
    SELECTIVE_KEPT,
    host_step_seconds,
    measure_host,
)

from .device import TruthDevice
from .rows import row

_VARIANTS = ("none", "torch", "full", "offload", SELECTIVE_KEPT)
_TWIN_CSV = Path(__file__).resolve().parents[1] / "calibration" / "host_twin.csv"  # the twin on the CI machine's CPU


def host_rows(device: TruthDevice, rounds: int) -> list[dict]:
    """Per narrow model and variant: the step's seconds and ratio over none on ``device``, and the planner's ratio;
    then this host's Python work in the wrapped blocks of both narrow models, each mode priced at this host's region
    costs over the catalogue's."""
    hardware = device.hardware()
    rows = []
    for name in NARROW_MODELS:
        on_device = host_step_seconds(name, rounds, wrappers=WRAPPERS, device=device.device)
        on_cpu = on_device if not device.is_cuda else host_step_seconds(name, rounds, wrappers=WRAPPERS)
        priced = priced_host_ratios(name, hardware.kernel_seconds, hardware.region_seconds)
        for variant in _VARIANTS:
            cpu_note = f"this machine's CPU: {on_cpu[variant] / on_cpu['none']:.3f}×" if device.is_cuda else ""
            rows.append(
                row(
                    "host",
                    name,
                    variant,
                    seconds=on_device[variant],
                    ratio=on_device[variant] / on_device["none"],
                    predicted_ratio=priced.get(variant, float("nan")),
                    note="; ".join(filter(None, ("narrow model, host-bound: over none", cpu_note))),
                )
            )
    rows += twin_rows(device, rounds)
    here = measure_host().region_seconds  # as the catalogue was measured (selective keeping its ops); once a process
    regions = [narrow_region(name) for name in NARROW_MODELS]
    speeds = {
        mode: _python_seconds(regions, here[mode]) / _python_seconds(regions, HOST_REGION_SECONDS[mode])
        for mode in HOST_REGION_SECONDS
    }
    rows.append(
        row(
            "host",
            "this host",
            "Python work of the wrapped blocks over the catalogue's",
            ratio=sum(speeds.values()) / len(speeds),
            note=", ".join(
                f"{mode} {here[mode][0] * 1e6:.0f} µs a call + {here[mode][1] * 1e6:.1f} µs an op ({speed:.2f}×)"
                for mode, speed in speeds.items()
            ),
        )
    )
    return rows


def twin_rows(device: TruthDevice, rounds: int) -> list[dict]:
    """r50's narrow twin on ``device``, each mode over none beside the H200's b32 ratios (from the committed twin
    CSV), then its unchecked step's time per kernel here, on the device and on this machine's CPU, over the CI
    machine's CPU's."""
    on_device = twin_seconds(rounds, device.device)
    on_cpu = on_device if not device.is_cuda else twin_seconds(rounds)
    committed = {line["variant"]: line for line in read_rows(_TWIN_CSV)}
    rows = [
        row(
            "host",
            "r50 twin",
            variant,
            seconds=on_device[variant],
            ratio=on_device[variant] / on_device["none"],
            note=f"H200 (r50 b32): {committed[variant]['h200']}×; this machine's CPU: "
            f"{on_cpu[variant] / on_cpu['none']:.3f}×; the CI machine's CPU: {committed[variant]['this_cpu']}×",
        )
        for variant in ("full", "selective")
    ]
    kernels = then_kernels()
    ci_cpu = float(committed[PER_KERNEL]["this_cpu"]) * 1e-6
    rows.append(
        row(
            "host",
            "r50 twin",
            "unchecked step, time per kernel over the CI machine's CPU's",
            seconds=on_device["none"] / kernels,
            ratio=on_device["none"] / kernels / ci_cpu,
            note=f"this machine's CPU: {on_cpu['none'] / kernels / ci_cpu:.2f}×; the H200's r50 b32: "
            f"{committed[PER_KERNEL]['h200']} µs a kernel, the CI machine's CPU {committed[PER_KERNEL]['this_cpu']} µs",
        )
    )
    return rows


def _python_seconds(regions: list[tuple[int, int]], prices: tuple[float, float]) -> float:
    """What ``prices`` (per call, per op) come to over ``regions`` of ``(calls, ops)``."""
    per_call, per_op = prices
    return sum(calls * per_call + ops * per_op for calls, ops in regions)
