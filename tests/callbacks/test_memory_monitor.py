import csv
import socket
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks import AdaptiveAccumulation, MemoryMonitor
from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import TINY_FACE, quiet_trainer, run_memopt_train


def _data(count=24, batch_size=6):
    return DataLoader(TensorDataset(torch.randn(count, 3, 32, 32), torch.arange(count) % 4), batch_size=batch_size)


def _module():
    return FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny", schedule="constant")


def _rows(tmp_path):
    with next(tmp_path.glob("**/metrics.csv")).open() as f:
        return list(csv.DictReader(f))


def _steps(rows, key):
    return [int(row["step"]) for row in rows if row.get(key)]


def test_monitor_keys_reach_a_csv_logger_every_n_steps(tmp_path):
    trainer = quiet_trainer(
        max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[MemoryMonitor(every_n_steps=2)]
    )
    trainer.fit(_module(), _data())
    rows = [row for row in _rows(tmp_path) if row.get("memopt/peak_allocated_gb")]
    # the first step of the fit, then the steps s with (s + 1) % 2 == 0, as Lightning's log_every_n_steps=2 counts
    assert [int(row["step"]) for row in rows] == [0, 1, 3]
    for row in rows:
        peak, live = float(row["memopt/peak_allocated_gb"]), float(row["memopt/allocated_gb"])
        assert peak >= live > 0


class _SizeLogging(FaceRecognitionModule):
    """Logs the size of each training batch next to its loss."""

    def training_step(self, batch, batch_idx):
        self.log("train/batch_size", float(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


_SMALL, _LARGE = 2, 12


def _sized_data(steps, accumulate):
    """Optimizer step k runs batches of 12 samples if k is odd, else of 2 (each of its micro-batches)."""
    sizes = [_LARGE if step % 2 else _SMALL for step in range(steps) for _ in range(accumulate)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    images, labels = torch.randn(sum(sizes), 3, 32, 32), torch.arange(sum(sizes)) % 4
    batches = [list(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)]
    return DataLoader(TensorDataset(images, labels), batch_sampler=batches)


@pytest.mark.parametrize(
    ("every_n_steps", "log_every_n_steps", "accumulate", "memopt_steps"),
    [
        (1, 1, 1, [0, 1, 2, 3, 4, 5]),
        (2, 1, 1, [0, 1, 3, 5]),
        (3, 3, 1, [0, 2, 5]),
        (1, 1, 2, [0, 1, 2, 3, 4, 5]),
        (2, 2, 3, [0, 1, 3, 5]),
    ],
)
def test_memopt_rows_share_the_step_and_the_batch_of_train_loss(
    tmp_path, every_n_steps, log_every_n_steps, accumulate, memopt_steps
):
    steps = 6
    trainer = quiet_trainer(
        max_steps=steps,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=log_every_n_steps,
        accumulate_grad_batches=accumulate,
        callbacks=[MemoryMonitor(every_n_steps=every_n_steps)],
    )
    trainer.fit(
        _SizeLogging(num_classes=4, backbone="iresnet_tiny", schedule="constant"), _sized_data(steps, accumulate)
    )
    rows = _rows(tmp_path)
    assert _steps(rows, "memopt/peak_allocated_gb") == memopt_steps  # once each: no step logged twice
    loss_steps = _steps(rows, "train/loss")
    assert loss_steps == [s for s in range(steps) if (s + 1) % log_every_n_steps == 0]
    shared = [s for s in memopt_steps if (s + 1) % log_every_n_steps == 0]
    assert set(shared) <= set(loss_steps)
    # the memory logged at a step is that step's batches': large after the steps of 12 samples, small after those of 2
    peaks = {
        int(row["step"]): float(row["memopt/peak_allocated_gb"]) for row in rows if row["memopt/peak_allocated_gb"]
    }
    sizes = {int(row["step"]): float(row["train/batch_size"]) for row in rows if row.get("train/batch_size")}
    assert all(sizes[s] == (_LARGE if s % 2 else _SMALL) for s in shared)
    large = [peaks[s] for s in memopt_steps if s % 2]
    small = [peaks[s] for s in memopt_steps if not s % 2]
    assert min(large) > 1.5 * max(small)


@pytest.mark.parametrize(
    "accumulation",
    [
        pytest.param(lambda: AdaptiveAccumulation(accumulate_schedule={0: 1, 2: 2}), id="AdaptiveAccumulation"),
        pytest.param(lambda: GradientAccumulationScheduler({0: 1, 1: 2}), id="GradientAccumulationScheduler"),
    ],
)
def test_no_step_is_logged_twice_when_the_accumulation_changes(tmp_path, accumulation):
    trainer = quiet_trainer(
        max_epochs=2,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=[MemoryMonitor(every_n_steps=1), accumulation()],
    )
    trainer.fit(_module(), _data(count=24, batch_size=6))  # 4 batches an epoch
    assert trainer.accumulate_grad_batches == 2
    rows = _rows(tmp_path)
    memopt_steps = _steps(rows, "memopt/peak_allocated_gb")
    assert memopt_steps == _steps(rows, "train/loss") == list(range(trainer.global_step))
    assert trainer.global_step < 8  # some steps accumulated two batches


def test_the_figures_reach_callback_metrics_and_the_progress_bar():
    monitor = MemoryMonitor(every_n_steps=1, prog_bar=True)
    trainer = quiet_trainer(max_steps=3, callbacks=[monitor])
    trainer.fit(_module(), _data())
    assert monitor.last_logged_step == 2
    for key in ("memopt/peak_allocated_gb", "memopt/allocated_gb"):
        assert (
            float(trainer.callback_metrics[key]) == pytest.approx(monitor.last_logged[key])
            and monitor.last_logged[key] > 0
        )
    assert set(trainer.progress_bar_metrics) >= {"memopt/peak_allocated_gb"}
    assert "memopt/allocated_gb" not in trainer.progress_bar_metrics
    assert not any(key.startswith("memopt/") for key in trainer.logged_metrics)  # the loggers get them directly


def test_model_checkpoint_monitors_the_peak(tmp_path):
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", monitor="memopt/peak_allocated_gb", mode="max", every_n_train_steps=1
    )
    trainer = quiet_trainer(
        max_steps=4,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=True,
        callbacks=[MemoryMonitor(every_n_steps=1), checkpoint],
    )
    trainer.fit(_module(), _data())
    peaks = [float(row["memopt/peak_allocated_gb"]) for row in _rows(tmp_path) if row["memopt/peak_allocated_gb"]]
    assert len(peaks) == 4
    assert checkpoint.best_model_score is not None
    assert float(checkpoint.best_model_score) == pytest.approx(max(peaks))
    # the best checkpoint is the one saved right after the step of the highest peak (global step = its step + 1)
    assert checkpoint.best_model_path.endswith(f"step={peaks.index(max(peaks)) + 1}.ckpt")


def test_early_stopping_monitors_the_peak():
    stopping = EarlyStopping(
        monitor="memopt/peak_allocated_gb", mode="min", stopping_threshold=1.0, check_on_train_epoch_end=True
    )
    trainer = quiet_trainer(max_epochs=5, callbacks=[MemoryMonitor(every_n_steps=1), stopping])
    trainer.fit(_module(), _data())  # the peak is far below 1 GB: stops after the first epoch
    assert stopping.stopped_epoch == 0 and trainer.global_step == 4


def test_the_cpu_peak_covers_parameters_gradients_and_optimizer_state(tmp_path):
    monitor = MemoryMonitor(every_n_steps=1)
    module = _module()
    trainer = quiet_trainer(max_steps=2, callbacks=[monitor])
    trainer.fit(module, _data())
    parameter_bytes = sum(p.numel() * 4 for p in module.parameters()) + sum(b.nbytes for b in module.buffers())
    # SGD with momentum: parameters + gradients + momentum buffers are all live at the optimizer step
    assert monitor.last_logged["memopt/peak_allocated_gb"] * 1e9 > 2.5 * parameter_bytes


def test_an_oom_writes_a_report_and_a_chart(tmp_path):
    pytest.importorskip("matplotlib")
    module = _module()
    monitor = MemoryMonitor(every_n_steps=1, report_dir=tmp_path / "reports")
    trainer = quiet_trainer(max_steps=3, callbacks=[monitor])
    with pytest.raises(torch.OutOfMemoryError), SimulatedDevice(budget_bytes=3 * 2**20, include=[module]):
        trainer.fit(module, _data(batch_size=24))
    report = (tmp_path / "reports" / "oom_report.txt").read_text()
    assert report.startswith("out of memory at step 0")
    assert "by category:" in report and "activations by top-level module:" in report
    assert "largest 15 tensors:" in report and "what to try" in report
    assert "halve the batch size and accumulate over 2" in report
    assert (tmp_path / "reports" / "oom_timeline.png").stat().st_size > 1000


def test_other_errors_write_nothing(tmp_path):
    class Broken(FaceRecognitionModule):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("not a memory problem")

    trainer = quiet_trainer(max_steps=1, callbacks=[MemoryMonitor(report_dir=tmp_path / "reports")])
    with pytest.raises(RuntimeError, match="not a memory problem"):
        trainer.fit(Broken(num_classes=4, backbone="iresnet_tiny"), _data())
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be an integer ≥ 1, got 0"),
        ({"every_n_steps": -5}, r"`every_n_steps` must be an integer ≥ 1, got -5"),
        ({"every_n_steps": "ten"}, r"`every_n_steps` must be an integer ≥ 1, got 'ten' \(str\)"),
        ({"every_n_steps": True}, r"`every_n_steps` must be an integer ≥ 1, got True \(bool\)"),
        ({"prometheus_port": 70000}, r"`prometheus_port` must be an integer ≥ 1 and ≤ 65535, got 70000"),
        ({"prometheus_port": "http"}, r"`prometheus_port` must be an integer ≥ 1 and ≤ 65535, got 'http' \(str\)"),
        ({"record_cuda_history": "maybe"}, r"`record_cuda_history` must be true or false, got 'maybe' \(str\)"),
        ({"report_dir": 3}, r"`report_dir` must be a path, got 3 \(int\)"),
        ({"prog_bar": "sometimes"}, r"`prog_bar` must be true or false, got 'sometimes' \(str\)"),
        (
            {"prometheus_address": "http://0.0.0.0"},
            r"`prometheus_address` must be an IP address or host name to bind, e\.g\. '127\.0\.0\.1' \(this machine "
            r"only\) or '0\.0\.0\.0' \(every interface\), got 'http://0\.0\.0\.0'",
        ),
        ({"prometheus_address": ""}, r"`prometheus_address` must be an IP address or host name .*, got ''"),
        ({"prometheus_address": 8080}, r"`prometheus_address` must be an IP address or host name .*, got 8080 \(int\)"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(MisconfigurationException, match="^MemoryMonitor: " + message):
        MemoryMonitor(**kwargs)


@pytest.mark.parametrize(("kwargs", "calls"), [({}, []), ({"record_cuda_history": True}, [True, False])])
def test_the_cuda_allocator_history_is_recorded_only_when_asked(monkeypatch, kwargs, calls):
    # the history costs a stack trace per allocation (a fit 1.43x slower on an H200): a default fit on CUDA
    # must not switch it on; asked for, it runs from setup to teardown
    recorded = []
    monkeypatch.setattr("lightning_memopt.callbacks.memory_monitor.record_cuda_memory_history", recorded.append)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    monitor = MemoryMonitor(**kwargs)
    monitor.setup(trainer, None, "fit")
    monitor.teardown(trainer, None, "fit")
    assert recorded == calls


def test_the_monitor_preset_leaves_the_cuda_history_off():
    from omegaconf import OmegaConf

    preset = OmegaConf.load(Path(__file__).parents[2] / "conf" / "memopt" / "monitor.yaml")
    assert preset.callbacks.memory_monitor.record_cuda_history is False


def test_record_cuda_history_reads_words():
    assert MemoryMonitor(record_cuda_history="off").record_cuda_history is False
    assert MemoryMonitor(record_cuda_history="on").record_cuda_history is True


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _gauges(body):
    return {line.split()[0]: float(line.split()[1]) for line in body.splitlines() if line.startswith("memopt_")}


class _Scraper(Callback):
    """Scrapes the endpoint at the start of training (before any sample) and at its end (before teardown)."""

    def __init__(self, port):
        self.port, self.bodies, self.bound = port, [], None

    def on_train_start(self, trainer, pl_module):
        self.bodies.append(_scrape(self.port))
        monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
        self.bound = monitor._gauges.server[0].socket.getsockname()[0]

    def on_train_end(self, trainer, pl_module):
        self.bodies.append(_scrape(self.port))


def test_prometheus_serves_the_cpu_gauges_on_localhost_until_teardown_and_a_second_fit_serves_again():
    pytest.importorskip("prometheus_client")
    port = _free_port()
    monitor = MemoryMonitor(every_n_steps=1, prometheus_port=port)
    for _ in range(2):  # the same callback, the same port: the first fit's server is closed at its teardown
        scraper = _Scraper(port)
        trainer = quiet_trainer(max_steps=2, callbacks=[monitor, scraper])
        trainer.fit(_module(), _data())
        before, after = (_gauges(body) for body in scraper.bodies)
        assert scraper.bound == "127.0.0.1"
        assert before == {}  # no gauge before the first sample, rather than a 0 never measured
        assert set(after) == {"memopt_peak_allocated_gb", "memopt_allocated_gb"}  # no CUDA-only gauge on the CPU
        assert after["memopt_peak_allocated_gb"] == pytest.approx(monitor.last_logged["memopt/peak_allocated_gb"])
        assert after["memopt_peak_allocated_gb"] >= after["memopt_allocated_gb"] > 0
        with pytest.raises(urllib.error.URLError):
            _scrape(port)
    # a server of another fit in this process on the same port works too
    trainer = quiet_trainer(max_steps=1, callbacks=[MemoryMonitor(every_n_steps=1, prometheus_port=port)])
    trainer.fit(_module(), _data())


def test_prometheus_is_closed_when_the_fit_fails():
    pytest.importorskip("prometheus_client")

    class Broken(FaceRecognitionModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("not a memory problem")
            return super().training_step(batch, batch_idx)

    port = _free_port()
    monitor = MemoryMonitor(every_n_steps=1, prometheus_port=port)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        quiet_trainer(max_steps=3, callbacks=[monitor]).fit(Broken(num_classes=4, backbone="iresnet_tiny"), _data())
    with pytest.raises(urllib.error.URLError):
        _scrape(port)
    with socket.socket() as again:  # the port is free again
        again.bind(("127.0.0.1", port))


def test_a_port_in_use_is_named():
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        trainer = quiet_trainer(max_steps=1, callbacks=[MemoryMonitor(prometheus_port=port)])
        with pytest.raises(OSError, match=rf"cannot serve the Prometheus gauges on 127\.0\.0\.1:{port}"):
            trainer.fit(_module(), _data())


def test_prometheus_address_is_kept_and_checked():
    assert MemoryMonitor().prometheus_address == "127.0.0.1"
    assert MemoryMonitor(prometheus_address="0.0.0.0").prometheus_address == "0.0.0.0"
    assert MemoryMonitor(prometheus_address="::1").prometheus_address == "::1"
    assert MemoryMonitor(prometheus_address="localhost").prometheus_address == "localhost"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_logs_every_rank_with_min_and_max(tmp_path):
    args = [
        *TINY_FACE,
        "strategy=ddp",
        "trainer.devices=2",
        "data.batch_size=4",
        "memopt=monitor",
        "memopt.callbacks.memory_monitor.every_n_steps=1",
    ]
    result = run_memopt_train(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in _rows(tmp_path) if row.get("memopt/peak_allocated_gb_max")]
    assert len(rows) == 2
    for row in rows:
        ranks = [float(row["memopt/peak_allocated_gb_rank0"]), float(row["memopt/peak_allocated_gb_rank1"])]
        assert float(row["memopt/peak_allocated_gb_min"]) == min(ranks) > 0
        assert float(row["memopt/peak_allocated_gb_max"]) == max(ranks)
