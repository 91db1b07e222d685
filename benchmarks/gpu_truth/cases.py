"""The models gpu_truth.py measures: every preset at a reduced input that fits one GPU, and the tiny dry-run set.

A case is a factory of the preset's LightningModule (its own loss and optimizer, as users train it) and
a seeded batch on the CPU. A suite says which cases each part of the run takes: ``full`` (every preset,
≤ 10 minutes on one H100), ``quick`` (one per family, ≤ 3) and ``dry`` (the tiny presets, on a CPU).

Example::

    >>> suite = SUITES["dry"]
    >>> [case.name for case in suite.predictions]
    ['iresnet_tiny b8 32²', 'sapiens_tiny b2 64×48', 'cotracker3_tiny 8f 16t 64²']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule, TrackingModule

_FACE_CLASSES = 1000


@dataclass(frozen=True)
class Case:
    """One preset at one input: ``build()`` its LightningModule, ``batch()`` a seeded training batch on the CPU."""

    name: str
    preset: str
    build: Callable[[], pl.LightningModule]
    batch: Callable[[], Any]


def face(preset: str, batch: int, size: int = 112, topo_weight: float = 0.0) -> Case:
    def build() -> pl.LightningModule:
        options = {} if size == 112 else {"input_size": size}
        return FaceRecognitionModule(
            num_classes=_FACE_CLASSES, backbone=preset, backbone_options=options, topo_weight=topo_weight
        )

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, size, size, generator=generator)
        return images, torch.randint(0, _FACE_CLASSES, (batch,), generator=generator)

    topo = f", TopoFR loss ×{topo_weight:g}" if topo_weight else ""
    return Case(f"{preset} b{batch} {size}²{topo}", preset, build, make_batch)


def normals(preset: str, batch: int, height: int, width: int) -> Case:
    def make_batch() -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return {
            "image": torch.randn(batch, 3, height, width, generator=generator),
            "normal": F.normalize(torch.randn(batch, 3, height, width, generator=generator), dim=1),
            "mask": torch.ones(batch, 1, height, width, dtype=torch.bool),
        }

    def build() -> pl.LightningModule:
        return NormalEstimationModule(backbone=preset, warmup_steps=0)  # the fits here last a few steps

    return Case(f"{preset} b{batch} {height}×{width}", preset, build, make_batch)


def tracking(preset: str, frames: int, tracks: int, height: int, width: int) -> Case:
    def make_batch() -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        scale = torch.tensor([width - 1, height - 1])
        return {
            "video": torch.rand(1, frames, 3, height, width, generator=generator) * 255,
            "tracks": torch.rand(1, frames, tracks, 2, generator=generator) * scale,
            "visibility": torch.ones(1, frames, tracks, dtype=torch.bool),
            "queries": torch.cat([torch.zeros(1, tracks, 1), torch.rand(1, tracks, 2, generator=generator) * scale], 2),
        }

    size = f"{height}²" if height == width else f"{height}×{width}"
    return Case(f"{preset} {frames}f {tracks}t {size}", preset, lambda: TrackingModule(backbone=preset), make_batch)


@dataclass(frozen=True)
class Suite:
    """Which cases each part of gpu_truth.py takes, and how many interleaved timing rounds."""

    predictions: list[Case]  # fake-mode prediction vs the device's peak, fp32 / bf16-mixed × none / full
    timings: list[Case]  # step time of each checkpointing policy and precision
    speed_targets: list[Case]  # timings that keep the GPU busy: held to issue 38's ratios on a GPU
    planning: list[Case]  # MemoryBudget's plan for a device capped below the case's unchecked peak
    margins: list[Case]  # the least device memory each runs on: the safety margin the predictions need
    recovery: Case  # AdaptiveAccumulation recovering a real OOM (no BatchNorm: micro-batches change nothing)
    overflow: Case  # PrecisionSwitch 16-mixed with an injected overflow
    monitor: Case  # MemoryMonitor's figures and overhead
    rounds: int
    monitor_steps: int


_R50, _SAPIENS, _COTRACKER = (
    face("r50", 32),
    normals("sapiens_0.3b", 1, 512, 384),
    tracking("cotracker3", 16, 256, 384, 512),
)
_COMPUTE_BOUND = (face("r100", 128), normals("sapiens_0.3b", 2, 1024, 768))
_TINY_FACE, _TINY_SAPIENS = face("iresnet_tiny", 8, 32), normals("sapiens_tiny", 2, 64, 48)
_TINY_TRACKER = tracking("cotracker3_tiny", 8, 16, 64, 64)

_FULL = Suite(
    predictions=[
        *(face(f"r{depth}", 32) for depth in (18, 34, 50, 100, 200)),
        *(normals(f"sapiens_{size}", 1, 512, 384) for size in ("0.3b", "0.6b", "1b", "2b")),
        *(tracking(preset, 16, 256, 384, 512) for preset in ("cotracker2", "cotracker3", "cotracker3_offline")),
    ],
    # the reduced sizes (bound by the host on an H200) and sizes that keep the GPU busy (issue 38)
    timings=[_R50, _SAPIENS, _COTRACKER, *_COMPUTE_BOUND],
    speed_targets=[_COTRACKER, *_COMPUTE_BOUND],
    planning=[_R50, _SAPIENS],  # MemoryBudget's profiles of cotracker3 (~100 s on a CPU) would pass 10 minutes
    margins=[_R50, _SAPIENS, _COTRACKER],  # one per family: 6 bisections of 6 two-step runs each
    recovery=normals("sapiens_0.3b", 8, 256, 192),
    overflow=_R50,
    monitor=_R50,
    rounds=3,
    monitor_steps=30,
)
SUITES = {
    "full": _FULL,
    "quick": replace(
        _FULL,
        predictions=[_R50, _SAPIENS, _COTRACKER],
        timings=[_R50, _COMPUTE_BOUND[0]],
        speed_targets=[_COMPUTE_BOUND[0]],
        planning=[_SAPIENS],
        rounds=2,
        monitor_steps=20,
    ),  # fmt: skip
    "dry": Suite(
        predictions=[_TINY_FACE, _TINY_SAPIENS, _TINY_TRACKER],
        timings=[_TINY_FACE, _TINY_SAPIENS],
        speed_targets=[_TINY_SAPIENS],  # the targets' arithmetic runs; a CPU's ratios are not judged against them
        planning=[_TINY_SAPIENS],
        margins=[_TINY_FACE, _TINY_SAPIENS, _TINY_TRACKER],
        recovery=normals("sapiens_tiny", 8, 64, 48),
        overflow=_TINY_FACE,
        monitor=_TINY_FACE,
        rounds=1,
        monitor_steps=4,
    ),
}


def repeated(batch: Any, steps: int) -> DataLoader:
    """A loader that yields ``batch`` as it is, ``steps`` times (no collation)."""
    return DataLoader([batch] * steps, batch_size=None)
