"""Exact resume: a fit resumed from its own step-k checkpoint ends with the uninterrupted fit's weights."""

from __future__ import annotations

import csv
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from lightning_memopt.callbacks import LastCheckpoint, RandomStateCheckpoint
from lightning_memopt.data import SyntheticFaceDataModule
from lightning_memopt.data.resumable import ResumableDataLoader
from lightning_memopt.random_generators import capture_random_state, restore_random_state
from lightning_memopt.tasks import FaceRecognitionModule
from tests.callbacks.interrupting import CtrlCAfterStep
from tests.helpers import REPO_ROOT, run_memopt_train, run_script


def _fit(
    root: Path,
    max_steps: int,
    ckpt_path: Path | None = None,
    every_step: bool = False,
    workers: int = 0,
    ctrl_c_after: int | None = None,
):
    """A tiny face fit with augmentation, dropout and Partial FC sampling; 5 batches an epoch."""
    pl.seed_everything(3, workers=True)
    datamodule = SyntheticFaceDataModule(
        num_classes=8,
        samples_per_class=5,
        val_samples_per_class=1,
        image_size=32,
        batch_size=8,
        num_workers=workers,
        augmentation={"hflip": 0.5, "rotation_degrees": 10, "color_jitter": 0.2},
    )
    model = FaceRecognitionModule(
        num_classes=8, backbone="iresnet_tiny", backbone_options={"input_size": 32, "dropout": 0.3}, sample_rate=0.5
    )
    callbacks = [RandomStateCheckpoint(), LastCheckpoint(root)]
    if ctrl_c_after is not None:
        callbacks.insert(0, CtrlCAfterStep(step=ctrl_c_after))
    if every_step:
        callbacks.append(ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=root,
        max_steps=max_steps,
        val_check_interval=3,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


@pytest.mark.parametrize(("workers", "steps"), [(0, (2, 5, 7)), (2, (5,))])
def test_a_resumed_fit_ends_with_the_uninterrupted_weights_bitwise(tmp_path, workers, steps):
    full = _fit(tmp_path / "full", 9, every_step=True, workers=workers)
    for step in steps:  # mid-epoch, the epoch's last batch (after a validation), the next epoch
        resumed = _fit(tmp_path / f"from{step}", 9, ckpt_path=tmp_path / "full" / f"step={step}.ckpt", workers=workers)
        assert torch.equal(resumed, full), f"resumed from step {step}: max |Δw| {(resumed - full).abs().max()}"


def test_a_fit_resumed_from_the_last_checkpoint_of_ctrl_c_ends_with_the_uninterrupted_weights(tmp_path):
    full = _fit(tmp_path / "full", 9)
    _fit(tmp_path / "stopped", 9, ctrl_c_after=3)  # mid-epoch: last.ckpt on the step boundary
    resumed = _fit(tmp_path / "resumed", 9, ckpt_path=tmp_path / "stopped" / "last.ckpt")
    assert torch.equal(resumed, full)


def test_overfit_batches_runs_on_lightnings_sampler(tmp_path):
    model = FaceRecognitionModule(num_classes=8, backbone="iresnet_tiny", backbone_options={"input_size": 32})
    datamodule = SyntheticFaceDataModule(num_classes=8, samples_per_class=5, image_size=32, batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=tmp_path,
        max_steps=2,
        overfit_batches=1,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 2


def test_without_the_random_states_a_resumed_fit_differs(tmp_path, monkeypatch):
    full = _fit(tmp_path / "full", 6, every_step=True)
    monkeypatch.setattr(RandomStateCheckpoint, "on_train_start", lambda *args: None)
    resumed = _fit(tmp_path / "resumed", 6, ckpt_path=tmp_path / "full" / "step=2.ckpt")
    assert not torch.equal(resumed, full)  # dropout and the sampled classes drew other numbers


def test_random_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    torch.save({"state": capture_random_state()}, tmp_path / "rng.pt")
    first = (torch.rand(3), __import__("numpy").random.rand(2).tolist(), __import__("random").random())
    restore_random_state(torch.load(tmp_path / "rng.pt", weights_only=True)["state"])
    again = (torch.rand(3), __import__("numpy").random.rand(2).tolist(), __import__("random").random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_a_short_fit_leaves_a_last_checkpoint(tmp_path):
    _fit(tmp_path, 2)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    assert len(checkpoint["callbacks"]["RandomStateCheckpoint"]["ranks"]) == 1


def _fit_pressing_ctrl_c(folder: Path, step: int, presses: int) -> tuple[pl.Trainer, LastCheckpoint]:
    callback = LastCheckpoint(folder)
    model = FaceRecognitionModule(num_classes=8, backbone="iresnet_tiny", backbone_options={"input_size": 32})
    datamodule = SyntheticFaceDataModule(num_classes=8, samples_per_class=5, image_size=32, batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=folder,
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        # pressed before LastCheckpoint looks at the step's end
        callbacks=[CtrlCAfterStep(step=step, presses=presses), callback],
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer, callback


def test_ctrl_c_stops_after_the_step_and_saves_it(tmp_path):
    handler = signal.getsignal(signal.SIGINT)
    trainer, callback = _fit_pressing_ctrl_c(tmp_path, step=3, presses=1)
    assert callback.interrupted and trainer.global_step == 3
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) is handler  # put back


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    with pytest.raises(SystemExit):  # Lightning ends an interrupted fit with exit status 1
        _fit_pressing_ctrl_c(tmp_path, step=2, presses=2)
    assert not (tmp_path / "last.ckpt").exists()


@pytest.mark.parametrize("presses", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_memopt_train_on_ctrl_c_exits_130(tmp_path, presses):
    args = [
        "model=iresnet_tiny",
        "data.image_size=32",
        "data.num_classes=8",
        "data.samples_per_class=4",
        "trainer.max_steps=50",
        "logger=none",
        f"callbacks.last_checkpoint.dirpath={tmp_path / 'checkpoints'}",
        f"+callbacks.ctrl_c={{_target_:tests.callbacks.interrupting.CtrlCAfterStep,step:2,presses:{presses}}}",
    ]
    result = run_memopt_train(args, cwd=tmp_path)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "memopt-train: stopped by Ctrl-C" in result.stderr and "Traceback" not in result.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    if presses == 1:
        # pressed after LastCheckpoint looked at step 2's end (it comes first in `callbacks`): the stop follows step 3
        assert torch.load(last, weights_only=False)["global_step"] == 3
    else:  # stopped at once: no checkpoint of a step cut short
        assert not last.exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["adaptive_precision", "ddp"])
def test_memopt_train_resumes_exactly(tmp_path, case):
    """memopt-train with memopt=[adaptive,precision], and under 2-rank DDP: bitwise the uninterrupted weights."""
    output = tmp_path / "gaps.csv"
    args = ["--cases", case, "--resume-from", "3", "--steps", "5", "--csv", str(output)]
    result = run_script(REPO_ROOT / "benchmarks" / "claims" / "exact_resume.py", args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = list(csv.DictReader(output.open()))
    assert [(row["case"], row["resumed_from_step"], float(row["max_abs_dw"])) for row in rows] == [(case, "3", 0.0)]


class _ForeignModule(pl.LightningModule):
    """A model the project never saw: a plain MLP with dropout on a TensorDataset, on our resumable loader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(16, 6, generator=generator), torch.randn(16, 1, generator=generator))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return ResumableDataLoader(self.data, batch_size=4)


def _fit_foreign(root: Path, ckpt_path: Path | None = None) -> torch.Tensor:
    pl.seed_everything(1)
    model = _ForeignModule()
    every_step = ModelCheckpoint(root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    callbacks = [RandomStateCheckpoint(), every_step]
    trainer = pl.Trainer(
        accelerator="cpu",
        default_root_dir=root,
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


def test_a_foreign_module_on_the_resumable_loader_resumes_bitwise(tmp_path):
    full = _fit_foreign(tmp_path / "full")
    for step in (3, 6):  # mid-epoch in the first and the second of 4-batch epochs
        resumed = _fit_foreign(tmp_path / f"from{step}", ckpt_path=tmp_path / "full" / f"step={step}.ckpt")
        assert torch.equal(resumed, full), f"resumed from step {step}"
