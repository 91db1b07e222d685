"""gpu_truth.py's failure rows: a real OOM recovered, a 16-mixed overflow skipped, and the project's ``cuda`` tests.

Example::

    >>> relative_difference([torch.ones(3)], [torch.ones(3)])
    0.0
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memopt.callbacks import AdaptiveAccumulation, PrecisionSwitch

from .cases import Case, repeated
from .device import TruthDevice
from .rows import row

_TESTS = Path(__file__).resolve().parents[2] / "tests"
GRADIENT_TOLERANCE = 1e-3  # the recovered steps' gradients against the whole batch's, relative (norm of the difference)


class StepGradients(pl.Callback):
    """Host copies of the gradients at each optimizer step (after every micro-batch was accumulated)."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append([p.grad.detach().to("cpu", copy=True) for p in pl_module.parameters() if p.grad is not None])


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """fp32 convolutions and matmuls without TF32 (cuDNN's default rounds their inputs to 10 bits, and which
    algorithm, so which rounding, depends on the batch size): a batch and its halves then differ by the order of
    their sums alone."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def relative_difference(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """‖ours − reference‖ / ‖reference‖ over all the tensors together."""
    difference = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(ours, reference, strict=True))
    return (difference / sum(float(b.double().square().sum()) for b in reference)) ** 0.5


def _batch_size(batch: Any) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.shape[0])


def recovery_row(device: TruthDevice, case: Case, steps: int = 2) -> dict:
    """A device capped between the whole batch's peak and half's: AdaptiveAccumulation must recover, same gradients."""
    batch = case.batch()
    size = _batch_size(batch)

    def fit(callbacks: list[pl.Callback], cap: int | None = None) -> tuple[StepGradients, Any, list[str]]:
        device.release()
        torch.manual_seed(0)
        module, gradients = case.build(), StepGradients()
        silenced = without_random_layers(module)
        trainer = device.trainer(steps, [*callbacks, gradients])
        measuring = device.peaks(include=(module,)) if cap is None else device.capped(cap, include=(module,))
        with measuring as peak:
            trainer.fit(module, repeated(batch, steps))
        return gradients, peak, silenced

    with exact_float32():
        reference, whole, silenced = fit([])
        _, half, _ = fit([AdaptiveAccumulation(micro_batch_size=size // 2)])
        held = [whole.held, half.held]
        cap = int(sum(held) / 2)
        accumulation = AdaptiveAccumulation()
        recovered, peak, _ = fit([accumulation], cap)
    sizer = accumulation.sizer
    # each step's gradients against the whole batch's; the later steps also carry the optimizer's earlier updates
    per_step = [relative_difference(*pair) for pair in zip(recovered.steps, reference.steps, strict=True)]
    difference = max(per_step)
    return row(
        "oom recovery",
        case.name,
        f"device capped at {cap / 2**20:.0f} MiB (whole batch {held[0] / 2**20:.0f}, half {held[1] / 2**20:.0f})",
        peak=peak,
        ratio=difference,
        passed=sizer.oom_recoveries >= 1 and (sizer.size or size) < size and difference <= GRADIENT_TOLERANCE,
        note=f"{sizer.oom_recoveries} OOM recovered; micro-batches of {sizer.size} (of {size}); "
        f"ratio: gradients' relative difference to the whole batch's (≤ {GRADIENT_TOLERANCE:g}), the largest of "
        f"the steps' ({', '.join(f'{value:.2g}' for value in per_step)}); fp32 without TF32; "
        f"dropout off in {len(silenced)} layer(s) (a CUDA mask differs per call)",
    )


def without_random_layers(module: torch.nn.Module) -> list[str]:
    """Set every dropout layer's ``p`` to 0; their names.

    The runner redoes a failed piece from the generators' state before it, so on the CPU (one sequential
    stream) 4 + 4 samples draw the 8 samples' masks; a CUDA mask depends on the call that draws it, so
    there the comparison with the whole batch holds only without random layers.
    """
    names = [name for name, layer in module.named_modules() if isinstance(layer, torch.nn.modules.dropout._DropoutNd)]
    for name in names:
        module.get_submodule(name).p = 0.0
    return names


class InjectedOverflow(pl.Callback):
    """At optimizer step ``step``, a gradient set to inf after the backward: the scaler must skip the step."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.before: list[torch.Tensor] = []
        self.unchanged = False
        self.scales: tuple[float, float] = (0.0, 0.0)

    def _scale(self, trainer: pl.Trainer) -> float:
        return float(trainer.precision_plugin.scaler.get_scale())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.before = [p.detach().clone() for p in pl_module.parameters()]
            self.scales = (self._scale(trainer), 0.0)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.before and not self.scales[1]:
            self.unchanged = all(torch.equal(a, b) for a, b in zip(self.before, pl_module.parameters(), strict=True))
            self.scales = (self.scales[0], self._scale(trainer))


def overflow_row(device: TruthDevice, case: Case, steps: int = 3) -> dict:
    """PrecisionSwitch 16-mixed with one injected overflow: step skipped, scale halved, training goes on finite."""
    device.release()
    torch.manual_seed(0)
    module, overflow = case.build(), InjectedOverflow()
    trainer = device.trainer(steps, [PrecisionSwitch("16-mixed"), overflow])
    trainer.fit(module, repeated(case.batch(), steps))
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    before, after = overflow.scales
    return row(
        "overflow",
        case.name,
        "16-mixed, inf gradient at step 1",
        ratio=after / before if before else float("nan"),
        passed=overflow.unchanged and after == before / 2 and finite and trainer.global_step == steps,
        note=f"step skipped: {overflow.unchanged}; loss scale {before:g} → {after:g} (ratio); "
        f"parameters finite: {finite}; {trainer.global_step} of {steps} steps",
    )


def cuda_test_files() -> list[Path]:
    """The test files with tests marked ``cuda``."""
    return sorted(path for path in _TESTS.rglob("test_*.py") if "pytest.mark.cuda" in path.read_text())


def cuda_tests_row(device: TruthDevice) -> dict:
    """``pytest -m cuda`` over the files that have such tests: all pass on CUDA (all skip on a CPU)."""
    files = cuda_test_files()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "cuda", "-p", "no:cacheprovider", *map(str, files)]
    done = subprocess.run(command, cwd=_TESTS.parent, capture_output=True, text=True, timeout=600, check=False)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-300:]
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    ran = counts.get("passed", 0) if device.is_cuda else counts.get("skipped", 0)
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    # which ones, so that a device lent for minutes says what to fix: "FAILED tests/x.py::test_y - Error: why"
    which = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return row(
        "cuda tests",
        f"{len(files)} files",
        "pytest -m cuda",
        passed=done.returncode == 0 and ran > 0 and bad == 0,
        note="; ".join([summary, *which]),
    )
