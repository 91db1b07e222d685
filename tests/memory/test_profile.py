import pytest
import torch
from torch import nn

from lightning_memopt.memory import SimulatedDevice, profile_step
from lightning_memopt.models import create_model
from lightning_memopt.tasks import FaceRecognitionModule, NormalEstimationModule


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_exact_bytes_of_a_linear_layer_step():
    layer = nn.Linear(256, 128, bias=False)  # 32768 parameters = 131072 B
    profile = profile_step(layer, torch.randn(16, 256), loss_fn=lambda m, x: m(x).sum(), optimizer=_sgd)
    assert profile.breakdown["parameters"] == 131072
    assert profile.breakdown["optimizer_state"] == 131072  # momentum buffer
    assert profile.breakdown["inputs"] == 16 * 256 * 4
    assert profile.peak_bytes == sum(profile.breakdown.values())
    assert profile.mode == "real-cpu" and profile.precision == "32-true"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(
    ("name", "build", "batch"),
    [
        (
            "iresnet_tiny",
            lambda: FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny"),
            lambda: (torch.randn(8, 3, 32, 32), torch.arange(8) % 10),
        ),
        (
            "sapiens_tiny",
            lambda: NormalEstimationModule(backbone="sapiens_tiny"),
            lambda: {
                "image": torch.randn(2, 3, 64, 48),
                "normal": nn.functional.normalize(torch.randn(2, 3, 64, 48)),
                "mask": torch.ones(2, 1, 64, 48, dtype=torch.bool),
            },
        ),
    ],
)
def test_fake_mode_predicts_the_real_peak_within_three_percent(name, build, batch, precision):
    torch.manual_seed(0)
    data = batch()
    fake = profile_step(build, data, mode="fake", precision=precision)
    real = profile_step(build(), data, mode="real", precision=precision)
    assert fake.mode == "fake"
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.03 * real.peak_bytes, (name, fake.peak_bytes, real.peak_bytes)
    assert fake.breakdown["parameters"] == real.breakdown["parameters"]


def test_fake_mode_allocates_nothing_for_a_large_model():
    profile = profile_step(
        lambda: create_model("r100"),
        torch.randn(64, 3, 112, 112),
        mode="fake",
        loss_fn=lambda m, x: m(x).square().mean(),
        optimizer=_sgd,
    )
    assert profile.breakdown["parameters"] == pytest.approx(65.16e6 * 4, rel=0.005)
    assert profile.breakdown["activations"] > profile.breakdown["parameters"]  # batch 64 at 112²
    assert profile.activations_by_module["layer1"] > profile.activations_by_module["layer4"]


def test_a_prediction_is_invisible_to_a_simulated_device_around_it():
    # MemoryBudget plans in fake mode inside the SimulatedDevice it plans for: a 4 MiB layer's step on a 1 MiB device
    batch = torch.randn(8, 1024)
    with SimulatedDevice(2**20) as device:
        profile = profile_step(lambda: nn.Linear(1024, 1024), batch, loss_fn=lambda m, x: m(x).sum(),
                               optimizer=lambda params: torch.optim.Adam(params), mode="fake")  # fmt: skip
    assert profile.peak_bytes > 16 * 2**20
    assert device.oom_count == 0 and device.peak.total_bytes == 0


def test_bf16_mixed_shrinks_the_activations():
    module = lambda: FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny")  # noqa: E731
    batch = (torch.randn(16, 3, 32, 32), torch.arange(16) % 10)
    fp32 = profile_step(module, batch, mode="fake")
    bf16 = profile_step(module, batch, mode="fake", precision="bf16-mixed")
    assert bf16.breakdown["activations"] < 0.8 * fp32.breakdown["activations"]


def test_the_table_lists_the_breakdown_and_modules():
    profile = profile_step(
        lambda: FaceRecognitionModule(num_classes=10, backbone="iresnet_tiny"),
        (torch.randn(4, 3, 32, 32), torch.arange(4)),
        mode="fake",
    )
    table = profile.table()
    assert table.startswith("peak ") and "activations by module" in table and "backbone" in table
    assert profile.largest and profile.largest[0].nbytes >= profile.largest[-1].nbytes


def test_prepare_model_runs_before_profiling():
    seen = []
    profile_step(
        nn.Linear(4, 4),
        torch.randn(2, 4),
        loss_fn=lambda m, x: m(x).sum(),
        optimizer=_sgd,
        prepare_model=lambda m: seen.append(type(m).__name__),
    )
    assert seen == ["Linear"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "dry"}, r"Unknown `mode`='dry'; valid choices: real, fake"),
        ({"precision": "fp8"}, r"Unknown `precision`='fp8'; valid choices: 32-true, bf16-mixed"),
        ({"steps": 0}, r"`steps`=0 must be at least 1"),
        ({"loss_fn": None}, r"`loss_fn` is needed to profile a plain Linear"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    options = {"loss_fn": lambda m, x: m(x).sum(), "optimizer": _sgd, **kwargs}
    with pytest.raises(ValueError, match=message):
        profile_step(nn.Linear(2, 2), torch.randn(1, 2), **options)


@pytest.mark.cuda
def test_on_cuda_the_peak_is_the_allocators():
    layer = nn.Linear(1024, 1024).cuda()
    profile = profile_step(layer, torch.randn(64, 1024, device="cuda"), loss_fn=lambda m, x: m(x).sum(), optimizer=_sgd)
    assert profile.mode == "real-cuda" and profile.peak_bytes >= profile.breakdown["parameters"] * 3
