"""benchmarks/calibration/cost_model_h200.py: the implementation the H200 measured, priced from its own work."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_memopt.planner.cost import StepCost
from tests.helpers import load_benchmark

cost_model = load_benchmark("calibration.cost_model_h200")


def test_the_measured_implementations_work_covers_every_case_and_variant():
    counts = cost_model.then_work()
    variants = ("none", *cost_model.POLICIES)
    assert set(counts) == {(name, variant) for name in cost_model._cases() for variant in variants}
    kernels = {key: value[0] for key, value in counts.items()}
    offloaded = {key: value[1] for key, value in counts.items()}
    for name in cost_model._cases():
        assert kernels[name, "full"] > kernels[name, "none"]  # recomputation launches kernels again
        assert offloaded[name, "offload"] > 0 and offloaded[name, "full"] == 0


def test_the_old_offload_wrapper_copies_saved_tensors_to_new_host_tensors_and_changes_no_gradient():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4, requires_grad=True)
    block(x).sum().backward()
    expected = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    x.grad = None
    block.zero_grad(set_to_none=True)
    packed = []
    pack = cost_model._OldOffload._pack
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost_model._OldOffload, "_pack", staticmethod(lambda t: packed.append(pack(t)) or packed[-1]))
        cost_model._OldOffload(block)(x).sum().backward()
    found = [x.grad, *(p.grad for p in block.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))
    copies = [item for item in packed if isinstance(item, tuple)]
    assert copies and all(host.device.type == "cpu" for _, host in copies)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept = [item for item in packed if not isinstance(item, tuple)]
    assert kept and all(item.untyped_storage().data_ptr() in weights for item in kept)  # weights stay put


def test_the_old_copies_run_in_line_with_the_kernels_while_the_host_queues_on(monkeypatch):
    case = cost_model._cases()["r50 b32 112²"]
    device_bound = StepCost(compute=0.05, memory=0.0, launch=0.01, offload=0.0, communication=0.0)
    step = SimpleNamespace(cost=lambda hardware: device_bound)
    monkeypatch.setattr(cost_model, "profiled_steps", lambda *args, **kwargs: {"none": step})
    h200 = cost_model.gpu("h200_141gb")
    counts = {(case.name, "none"): (5000.0, 8e9)}  # 8 GB out and back: 16 GB over the host link
    (then, now, bound) = cost_model.predicted(case, {}, counts)["none"]
    link = 16e9 / (h200.host_link_gbps * 1e9)
    host = 5000 * h200.kernel_seconds
    assert 0.05 < host < 0.05 + link
    assert then == pytest.approx(0.05 + link)  # the device waits for the copies; the host's kernels overlap them
    assert now == pytest.approx(0.05) and bound == "device"
    counts = {(case.name, "none"): (1e5, 0.0)}  # a host queuing 100,000 kernels sets the step's time
    assert cost_model.predicted(case, {}, counts)["none"][0] == pytest.approx(1e5 * h200.kernel_seconds)


def test_the_summary_names_the_ratios_off_and_each_cases_base(tmp_path):
    path = tmp_path / "cost.csv"
    fields = ["case", "variant", "measured_ratio", "predicted_ratio", "deviation", "forecast_ratio", "forecast_bound"]
    rows = [
        ["a", cost_model.UNCHECKED, "0.1", "0.08", "-0.200", "0.08", "device"],
        ["a", "selective", "2.0", "2.1", "+0.050", "1.5", "host"],
        ["a", "full", "1.5", "1.2", "-0.200", "1.3", "device"],
        ["a", "offload", "3.0", "3.3", "+0.100", "2.0", "host link"],
        ["a", "fastest mode", "full", "full", "same", "full", ""],
    ]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        writer.writerows(rows)
    text = " ".join(cost_model.summary(path).split())
    assert text.startswith("2 of the 3 predicted ratios are within 15% of the H200's")
    assert "the fastest mode is predicted in 1 of 1 cases; off by more: a full (-20%)." in text
    assert text.endswith("predicted -20% (a) off the measured one.")


def _row(variant, predicted, forecast, bound):
    return {"case": "c", "variant": variant, "predicted_ratio": predicted, "forecast_ratio": forecast,
            "forecast_bound": bound}  # fmt: skip


def test_forecast_only_keeps_the_predictions_and_takes_the_fresh_forecasts():
    kept = [_row("full", "1.5", "1.6", "host"), _row("offload", "3.0", "2.0", "host")]
    fresh = [_row("offload", "9.9", "2.5", "link"), _row("full", "9.9", "1.3", "device")]
    assert cost_model.with_forecasts(kept, fresh) == [_row("full", "1.5", "1.3", "device"),
                                                      _row("offload", "3.0", "2.5", "link")]  # fmt: skip
