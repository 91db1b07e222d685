"""Helpers shared by the test modules: tiny-run overrides, memopt-train in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]

# Overrides that shrink any face experiment to a CPU run of a few seconds.
TINY_FACE = [
    "model.backbone=iresnet_tiny",
    "data.image_size=32",
    "data.num_classes=8",
    "data.samples_per_class=4",
    "data.val_samples_per_class=1",
    "data.batch_size=8",
    "trainer=cpu",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]


def run_memopt_train(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_memopt.train ARGS`` on this checkout, in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_memopt.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_face_folder(root: Path, counts: dict[str, int], size: tuple[int, int] = (16, 16), seed: int = 0) -> Path:
    """Write ``counts[name]`` random RGB PNGs of ``size`` (width, height) into ``root/name``."""
    rng = np.random.default_rng(seed)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for index in range(count):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index:03d}.png")
    return root


def quiet_trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or model summary; ``kwargs`` override."""
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(**options)
