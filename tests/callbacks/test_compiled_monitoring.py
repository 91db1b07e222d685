"""MemoryMonitor and TrainingSummary on a compiled model: the CPU tracker is skipped, compilation keeps working."""

import warnings

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.compile import from_compiled
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks import MemoryMonitor, TrainingSummary
from lightning_memopt.memory.compiled import compiled_parts
from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import quiet_trainer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _RecordingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them eagerly."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def _data():
    return DataLoader(TensorDataset(torch.randn(24, 3, 32, 32), torch.arange(24) % 4), batch_size=6)


class _Classifier(LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.backbone(images), labels)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_compiled(callbacks):
    """Fit 4 steps with the backbone compiled; how many graphs dynamo compiled, and the warnings given."""
    torch._dynamo.reset()
    backend = _RecordingBackend()
    module = _Classifier()
    module.backbone = torch.compile(module.backbone, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=4, callbacks=callbacks).fit(module, _data())
    return backend.graphs, [str(w.message) for w in caught]


def test_graphs_still_compile_with_the_monitor_and_the_summary_on():
    without, _ = _fit_compiled([])
    monitor = MemoryMonitor(every_n_steps=1)
    summary = TrainingSummary(memory_batch=0)
    with_callbacks, messages = _fit_compiled([monitor, summary])
    assert without > 0
    assert with_callbacks == without  # not one frame left to eager mode by a tracked step
    skipped = [m for m in messages if m.startswith("MemoryMonitor: skipping the CPU memory tracker")]
    assert skipped == [
        "MemoryMonitor: skipping the CPU memory tracker: the model runs compiled code (backbone (torch.compile'd "
        "module)), and tracking a step would turn torch.compile off for the rest of the run. No memopt/* memory "
        "figures are logged on the CPU (on CUDA they come from the allocator and work with torch.compile)"
    ]  # once, though every step is sampled
    assert monitor.last_logged == {} and monitor.last_tracked is None
    summary_warnings = [m for m in messages if m.startswith("TrainingSummary: not counting")]
    assert len(summary_warnings) == 1 and "backbone (torch.compile'd module)" in summary_warnings[0]
    assert summary.summary.peak_memory_source.endswith("(MemoryTracker skipped: compiled model)")
    assert summary.summary.peak_rss_bytes > 10 * 2**20 and summary.summary.peak_memory_bytes is None
    assert summary.summary.timed_samples == summary.summary.samples == 24  # no batch was slowed by tracking


def test_a_tracked_step_would_have_turned_compilation_off():
    # what the skip prevents: a step run under the tracker's dispatch mode leaves the frame to eager mode for good
    from lightning_memopt.memory.tracker import MemoryTracker

    backend = _RecordingBackend()
    net = torch.compile(nn.Linear(4, 4), backend=backend)
    with MemoryTracker():
        net(torch.randn(2, 4))
    net(torch.randn(2, 4))
    assert backend.graphs == 0


def test_an_uncompiled_model_is_tracked_without_warning():
    monitor = MemoryMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny", schedule="constant")
        quiet_trainer(max_steps=2, callbacks=[monitor]).fit(module, _data())
    assert not [w for w in caught if "compiled" in str(w.message)]
    assert monitor.last_logged["memopt/peak_allocated_gb"] > 0


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_compiled_parts_finds_each_way_of_compiling():
    assert compiled_parts(_Net()) == []
    net = _Net()
    net.body = torch.compile(net.body)
    assert compiled_parts(net) == ["body (torch.compile'd module)"]
    net = _Net()
    net.head.compile()
    assert compiled_parts(net) == ["head (Module.compile())"]
    net = _Net()
    net.forward = torch.compile(net.forward)
    assert compiled_parts(net) == ["_Net.forward (torch.compile)"]

    class Decorated(nn.Module):
        @torch.compile
        def forward(self, x):
            return x

    assert compiled_parts(nn.Sequential(Decorated())) == ["0.forward (torch.compile)"]
    # trainer.fit(torch.compile(model)): Lightning unwraps it and compiles forward and every step method
    module = from_compiled(torch.compile(FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny")))
    assert compiled_parts(module) == [
        f"FaceRecognitionModule.{method} (torch.compile)"
        for method in ("forward", "training_step", "validation_step", "test_step", "predict_step")
    ]
