import csv

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks import MemoryMonitor
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


def test_monitor_keys_reach_a_csv_logger_every_n_steps(tmp_path):
    trainer = quiet_trainer(
        max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[MemoryMonitor(every_n_steps=2)]
    )
    trainer.fit(_module(), _data())
    rows = [row for row in _rows(tmp_path) if row.get("memopt/peak_allocated_gb")]
    assert [int(row["step"]) for row in rows] == [1, 3]  # the steps that started at global steps 0 and 2
    for row in rows:
        peak, live = float(row["memopt/peak_allocated_gb"]), float(row["memopt/allocated_gb"])
        assert peak >= live > 0


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
    assert "micro-batches of half the batch" in report
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
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(MisconfigurationException, match="^MemoryMonitor: " + message):
        MemoryMonitor(**kwargs)


def test_record_cuda_history_reads_words():
    assert MemoryMonitor(record_cuda_history="off").record_cuda_history is False
    assert MemoryMonitor(record_cuda_history="on").record_cuda_history is True


def test_prometheus_gauges_are_served(tmp_path):
    pytest.importorskip("prometheus_client")
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trainer = quiet_trainer(max_steps=2, callbacks=[MemoryMonitor(every_n_steps=1, prometheus_port=port)])
    trainer.fit(_module(), _data())
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    value = next(line for line in body.splitlines() if line.startswith("memopt_peak_allocated_gb "))
    assert float(value.split()[1]) > 0


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
