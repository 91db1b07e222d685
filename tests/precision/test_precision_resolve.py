import pytest
import torch

from lightning_memopt.precision import (
    auto_precision,
    mantissa_bits,
    normalise_precision,
    step_down,
    supports_bf16,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_on_the_cpu_is_bf16_mixed():
    precision, reason = auto_precision(CPU)
    assert precision == "bf16-mixed"
    assert "CPU" in reason


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), "bf16-mixed"), ((8, 0), "bf16-mixed"), ((8, 6), "bf16-mixed"), ((7, 5), "16-mixed"), ((7, 0), "16-mixed"),
     ((6, 1), "32-true")],
)  # fmt: skip
def test_auto_follows_the_cuda_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    precision, reason = auto_precision(CUDA)
    assert precision == expected
    assert f"{capability[0]}.{capability[1]}" in reason
    assert auto_precision(CUDA, capability=capability)[0] == expected


def test_auto_on_other_devices_is_32_true():
    assert auto_precision(torch.device("mps"))[0] == "32-true"


def test_bf16_support():
    assert supports_bf16(CPU)
    assert supports_bf16(CUDA, capability=(8, 0))
    assert not supports_bf16(CUDA, capability=(7, 0))
    assert not supports_bf16(torch.device("mps"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), (32, "32-true"), ("32-true", "32-true"),
     ("16-mixed", "16-mixed"), ("bf16-mixed", "bf16-mixed")],
)  # fmt: skip
def test_lightning_strings_and_aliases(value, expected):
    assert normalise_precision(value) == expected


def test_unknown_precision_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"Unknown `precision`='fp8'; valid choices: 32-true, bf16-mixed, 16-mixed"):
        normalise_precision("fp8")


def test_weight_precisions_point_to_the_trainer():
    with pytest.raises(ValueError, match=r"`precision`='bf16-true' converts the weights.*Trainer\(precision=\.\.\.\)"):
        normalise_precision("bf16-true")


def test_the_fail_safe_ladder():
    assert step_down("16-mixed", CPU) == "bf16-mixed"
    assert step_down("16-mixed", CUDA, capability=(7, 0)) == "32-true"  # V100: no bf16 to step down to
    assert step_down("bf16-mixed", CUDA, capability=(9, 0)) == "32-true"
    assert step_down("32-true", CPU) is None


def test_mantissa_bits_name_each_precision():
    assert (mantissa_bits("32-true"), mantissa_bits("bf16-mixed"), mantissa_bits("16-mixed")) == (23, 7, 10)
