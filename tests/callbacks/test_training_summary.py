import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks import TrainingSummary
from lightning_memopt.callbacks.training_summary import _process_peak_rss_bytes, _reset_process_peak_rss
from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import quiet_trainer


def _fit(tmp_path, summary, max_steps=3, accelerator="cpu"):
    data = DataLoader(TensorDataset(torch.randn(24, 3, 32, 32), torch.arange(24) % 4), batch_size=6)
    trainer = quiet_trainer(
        accelerator=accelerator, max_steps=max_steps, callbacks=[summary], default_root_dir=tmp_path
    )
    trainer.fit(FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny"), data)
    return trainer


def test_summary_counts_steps_samples_and_reports_the_last_logged_loss(tmp_path, capsys):
    summary = TrainingSummary()
    trainer = _fit(tmp_path, summary)
    figures = summary.as_dict()
    assert figures["steps"] == 3 and figures["samples"] == 18
    assert figures["final_loss"] == pytest.approx(float(trainer.callback_metrics["train/loss"]))
    assert figures["samples_per_second"] == pytest.approx(18 / figures["train_seconds"])
    assert figures["peak_memory_bytes"] > 10 * 2**20
    printed = "".join(capsys.readouterr())
    assert "memopt-train summary" in printed and "optimizer steps   3" in printed


def test_a_second_fit_starts_a_fresh_summary(tmp_path):
    summary = TrainingSummary()
    _fit(tmp_path, summary, max_steps=3)
    _fit(tmp_path, summary, max_steps=1)
    assert summary.summary.steps == 1 and summary.summary.samples == 6


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset is Linux-only")
def test_peak_rss_resets_between_fits():
    assert _reset_process_peak_rss()
    baseline = _process_peak_rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    raised = _process_peak_rss_bytes()
    del block
    assert raised - baseline > 48 * 2**20
    assert _reset_process_peak_rss()
    assert _process_peak_rss_bytes() < raised - 32 * 2**20


@pytest.mark.cuda
def test_on_a_gpu_the_peak_is_the_allocator_peak_of_this_fit(tmp_path):
    summary = TrainingSummary()
    _fit(tmp_path, summary, accelerator="gpu")
    assert summary.summary.peak_memory_source == "CUDA allocator peak"
    assert 0 < summary.summary.peak_memory_bytes == torch.cuda.max_memory_allocated()
