"""The host's cost of checkpointing, measured in CI: a regression of the host work shows without a GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt.memory.work import KernelCounter
from lightning_memopt.planner.host import (
    NARROW_MODELS,
    WRAPPERS,
    HostCosts,
    host_step_ratios,
    host_step_seconds,
    measure_host,
    narrow_model,
    priced_host_ratios,
)
from lightning_memopt.private_api import disable_current_modes
from tests.helpers import load_benchmark

host_overhead = load_benchmark("host_overhead")


@pytest.mark.slow  # ~40 s: every variant of both narrow models, interleaved (CI runs it after the default run)
def test_full_costs_the_host_no_more_than_torch_utils_checkpoint_and_selective_no_more_than_full(tmp_path):
    path = tmp_path / "host.csv"
    assert host_overhead.main(["--quick", "--csv", str(path)]) == 0
    rows = host_overhead.read_rows(path)
    for name in NARROW_MODELS:
        ratio = {row["variant"]: float(row["over_none"]) for row in rows if row["model"] == name}
        assert ratio["none"] == 1.0
        assert ratio["full"] <= host_overhead.FULL_OVER_TORCH * ratio["torch"], (name, ratio)
        assert ratio["selective"] <= host_overhead.SELECTIVE_OVER_FULL * ratio["full"], (name, ratio)
    regions = [row for row in rows if row["variant"].endswith("region per forward kernel")]
    assert [row["variant"].split(":")[0] for row in regions] == [
        "torch",
        "full",
        "selective",
        "offload",
        "selective kept",
    ]
    table = host_overhead.table(path)
    assert "| cnn | full |" in table and "region" not in table


def test_the_targets_missed_are_named_with_their_numbers():
    rows = [
        {"model": name, "variant": variant, "over_none": value}
        for name in NARROW_MODELS
        for variant, value in (("none", "1"), ("torch", "2.0"), ("full", "2.2"), ("selective", "2.1"))
    ]
    assert host_overhead.misses(rows) == [
        f"{name}: full 2.20× over torch's 2.00× (limit ×1.05)" for name in NARROW_MODELS
    ]
    rows[-1]["over_none"] = "2.3"  # within the noise of two runs of the same work
    assert len(host_overhead.misses(rows)) == 2
    rows[-1]["over_none"] = "3.0"
    assert host_overhead.misses(rows)[-1] == "transformer: selective 3.00× is slower than full 2.20× (limit ×1.05)"


def test_host_costs_are_measured_once_per_process():
    first = measure_host()
    assert isinstance(first, HostCosts) and first.kernel_seconds > 0
    assert set(first.region_seconds) == {"full", "selective", "offload"}
    assert measure_host() is first


def test_the_narrow_models_refuse_an_unknown_name():
    with pytest.raises(ValueError, match=r"Unknown `name`='mlp'; valid choices: cnn, transformer"):
        narrow_model("mlp")
    assert host_step_ratios("transformer", rounds=1)["none"] == 1.0


def _kernels_of_a_steady_step(variant: str) -> int:
    torch.manual_seed(0)
    model, x = narrow_model("cnn")
    model = WRAPPERS[variant](model)
    model(x).sum().backward()  # the gradients exist from here on, as in every later step
    with disable_current_modes(), KernelCounter() as counter:
        model(x).sum().backward()
    return counter.kernels


def test_the_planner_prices_a_narrow_step_by_its_kernels_and_each_wrapped_forward_kernels_python_work():
    none, full = _kernels_of_a_steady_step("none"), _kernels_of_a_steady_step("full")
    model, x = narrow_model("cnn")
    with disable_current_modes(), KernelCounter() as counter:
        model(x)
    forward = counter.kernels
    assert full - none == forward  # full recomputes each block's forward once
    free = priced_host_ratios("cnn", 1e-5, dict.fromkeys(("full", "selective", "offload"), (0.0, 0.0)))
    assert free["none"] == 1.0 and free["full"] == pytest.approx(full / none)
    regions = {"full": (0.0, 3e-5), "selective": (0.0, 0.0), "offload": (0.0, 0.0)}
    priced = priced_host_ratios("cnn", 1e-5, regions)
    assert priced["full"] - free["full"] == pytest.approx(forward * 3e-5 / (none * 1e-5))
    assert priced["offload"] == free["offload"] and set(priced) == {"none", "full", "offload", "selective kept"}
    per_call = priced_host_ratios("cnn", 1e-5, {**regions, "offload": (2e-4, 0.0)})
    assert per_call["offload"] - free["offload"] == pytest.approx(len(model) * 2e-4 / (none * 1e-5))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_narrow_models_time_their_host_beside_a_gpu():
    seconds = host_step_seconds("cnn", rounds=1, steps=1, device="cuda")
    assert set(seconds) == set(WRAPPERS) and all(0 < value < 10 for value in seconds.values())
