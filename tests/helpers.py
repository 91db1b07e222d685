"""Helpers shared by the test modules: tiny-run overrides, memopt-train in a subprocess."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"


class ResidualMLP(nn.Module):
    """A block of a transformer's shape without its attention: x + down(relu(up(x))), 4× wide inside."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(self.up(x).relu())


def load_benchmark(name: str):
    """The benchmark module ``name``, by its place under ``benchmarks/`` (``"claims.compile_budget"``,
    ``"gpu_truth.harness"``, ``"host_steps"``). ``benchmarks/`` goes on ``sys.path``, as each script puts it there:
    the benchmarks import the shared tools and each other's wings from it (their names are wing-qualified, so
    ``tests/foreign_models.py`` never meets ``claims/foreign_models.py``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


# Trainer overrides shared by every tiny run: two CPU steps with one validation batch.
TINY_TRAINER = [
    "trainer=cpu",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]

# Overrides that shrink any face experiment to a CPU run of a few seconds.
TINY_FACE = [
    "model.backbone=iresnet_tiny",
    "data.image_size=32",
    "data.num_classes=8",
    "data.samples_per_class=4",
    "data.val_samples_per_class=1",
    "data.batch_size=8",
    *TINY_TRAINER,
]

# The same for the surface-normal (Sapiens) experiments.
TINY_NORMALS = [
    "model.backbone=sapiens_tiny",
    "model.warmup_steps=1",
    "data.image_size=[64,48]",
    "data.num_samples=4",
    "data.val_samples=2",
    "data.batch_size=2",
    *TINY_TRAINER,
]

# The same for the point-tracking (CoTracker) experiments, with the preset's tiny model.
TINY_TRACKING = [
    "data.image_size=[64,64]",
    "data.sequence_len=8",
    "data.traj_per_sample=16",
    "data.num_clips=4",
    "data.val_clips=1",
    "data.batch_size=2",
    *TINY_TRAINER,
]


def tiny_overrides(cfg) -> list[str]:
    """Overrides that shrink the experiment composed in ``cfg`` to a CPU run of a few seconds."""
    task = cfg.model._target_.rsplit(".", 1)[-1]
    if task == "TrackingModule":
        return [f"model={cfg.model.backbone}_tiny", *TINY_TRACKING]
    return {"FaceRecognitionModule": TINY_FACE, "NormalEstimationModule": TINY_NORMALS}[task]


def run_memopt_train(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_memopt.train ARGS`` on this checkout, in ``cwd``."""
    return run_python(["-m", "lightning_memopt.train", *args], cwd, timeout)


def run_script(script: Path, args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python SCRIPT ARGS`` with this checkout importable (``tests.…`` included), in ``cwd``."""
    return run_python([str(script), *args], cwd, timeout)


def run_python(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def run_ranks(
    script: Path, args: list[str], cwd: Path, timeout: float, world_size: int = 2
) -> list[subprocess.CompletedProcess]:
    """Run ``python SCRIPT ARGS`` as ``world_size`` ranks started like torchrun's, in ``cwd``; one result per rank.

    No launcher watches them (Lightning's would kill the others when one fails), so each rank must
    end by itself. Raises ``subprocess.TimeoutExpired`` once ``timeout`` seconds have passed with a
    rank still running, after killing every rank; ``cwd/rank{r}.log`` holds each rank's output.
    """
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), NODE_RANK="0")
    logs = [cwd / f"rank{rank}.log" for rank in range(world_size)]
    command = [sys.executable, str(script), *args]
    ranks = []
    for rank, log in enumerate(logs):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with log.open("w") as output:  # a file, not a pipe: a rank blocked on a full pipe would hold up the others
            ranks.append(subprocess.Popen(command, cwd=cwd, env=rank_env, stdout=output, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for process in ranks:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [
        subprocess.CompletedProcess(command, p.returncode, log.read_text(), "")
        for p, log in zip(ranks, logs, strict=True)
    ]


def _env(**variables: str) -> dict[str, str]:
    """This environment with the checkout importable (``tests.…`` included), and ``variables``."""
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **variables}


def write_face_folder(root: Path, counts: dict[str, int], size: tuple[int, int] = (16, 16), seed: int = 0) -> Path:
    """Write ``counts[name]`` random RGB PNGs of ``size`` (width, height) into ``root/name``."""
    rng = np.random.default_rng(seed)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for index in range(count):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index:03d}.png")
    return root


def tensors_only(hardware):
    """``hardware`` without library workspaces: a plan of a tiny model whose real peak the CPU measures (no cuBLAS)."""
    from dataclasses import replace

    return replace(hardware, workspace=None)


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


def unit_normals(height, width, seed=0):
    normals = np.random.default_rng(seed).normal(size=(height, width, 3)).astype(np.float32)
    normals[..., 2] = np.abs(normals[..., 2]) + 0.1
    return normals / np.linalg.norm(normals, axis=2, keepdims=True)


def write_normals_sample(root, name, size=(6, 8), normals=None, mask=None, extension=".png", seed=0):
    """Write images/<name><ext> of size (H, W), normals/<name>.npy and, if given, masks/<name>.png."""
    height, width = size
    for folder in ("images", "normals", "masks"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "images" / f"{name}{extension}")
    np.save(root / "normals" / f"{name}.npy", unit_normals(height, width, seed) if normals is None else normals)
    if mask is not None:
        Image.fromarray(mask.astype(np.uint8) * 255).save(root / "masks" / f"{name}.png")
    return pixels


def write_normals_folder(root: Path, count: int, size: tuple[int, int]) -> Path:
    """A normals folder of ``count`` random samples of ``size`` (H, W), without masks."""
    for index in range(count):
        write_normals_sample(root, f"{index:03d}", size=size, seed=index)
    return root


def write_tracking_folder(root: Path, count: int, frames: int = 8, size: int = 32, tracks: int = 20) -> Path:
    """``count`` random ``.npz`` tracking clips with every track visible in every frame."""
    from lightning_memopt.data.tracking_npz import write_tracking_clip

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        video = rng.integers(0, 256, size=(frames, size, size, 3), dtype=np.uint8)
        positions = rng.uniform(0, size - 1, size=(frames, tracks, 2)).astype(np.float32)
        write_tracking_clip(root / f"{index:03d}.npz", video, positions, np.ones((frames, tracks), dtype=bool))
    return root


def fake_activation_peak(build, batch, loss_fn, policy=None) -> int:
    """The activation peak (temporaries too) of one fake-mode step of ``build()`` on ``batch``, its blocks
    checkpointed by ``policy`` (``None``: not at all); the SGD step's gradients are there from the start."""
    from lightning_memopt.checkpointing import apply_activation_checkpointing
    from lightning_memopt.memory import profile_step

    def prepare(model):
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        if policy:
            apply_activation_checkpointing(model, policy)

    profile = profile_step(
        build, batch, loss_fn=loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), mode="fake", steps=1,
        prepare_model=prepare,
    )  # fmt: skip
    return profile.peak_bytes - sum(
        profile.breakdown[k] for k in ("parameters", "gradients", "inputs", "optimizer_state")
    )


def keep_expensive_counted(monkeypatch) -> list:
    """Every ``KeepExpensive`` that selective recomputation makes from now on (the dispatch-mode way), in a list."""
    from lightning_memopt.checkpointing import recompute
    from lightning_memopt.checkpointing.selective import KeepExpensive

    made: list[KeepExpensive] = []

    class Counted(KeepExpensive):
        def __init__(self, timed: bool = False) -> None:
            super().__init__(timed)
            made.append(self)

    monkeypatch.setattr(recompute, "KeepExpensive", Counted)
    return made
