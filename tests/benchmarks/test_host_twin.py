"""benchmarks/calibration/host_twin.py: the H200's host-bound r50 case as a narrow twin on this CPU."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.helpers import load_benchmark

host_twin = load_benchmark("calibration.host_twin")


def _gradients(variant: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = host_twin.twin(variant)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(2, 3, 16, 16, generator=generator), torch.randint(0, 16, (2,), generator=generator))
    loss = module.training_step(batch, 0)
    loss.backward()
    names = {
        name.replace(".block.block.", "."): p.grad for name, p in module.backbone.named_parameters() if p.requires_grad
    }
    return loss.detach(), names


def test_the_twin_wraps_every_r50_block_and_trains_as_the_unwrapped_twin():
    loss, expected = _gradients("none")
    assert len(expected) > 24 * 5  # 24 blocks (3 + 4 + 14 + 3), each with convolutions, norms and a PReLU
    for variant in ("full", "selective"):
        module = host_twin.twin(variant)
        wrapped = [m for m in module.backbone.modules() if isinstance(m, host_twin._OldCheckpoint)]
        assert len(wrapped) == 24
        assert all(("context_fn" in m.block.options) == (variant == "selective") for m in wrapped)
        found_loss, found = _gradients(variant)
        assert torch.equal(found_loss, loss)
        assert found.keys() == expected.keys()
        assert all(torch.allclose(found[name], expected[name], atol=1e-6) for name in expected), variant


def test_the_twin_is_timed_variant_by_variant():
    seconds = host_twin.twin_seconds(rounds=1)
    assert set(seconds) == set(host_twin.VARIANTS)
    assert all(0 < value < float("inf") for value in seconds.values())


def test_the_planner_prices_the_h200_cases_wrapped_blocks_at_the_measured_implementations_costs(monkeypatch):
    """Timed at 10 µs a kernel (full and selective 3× and 4× none) and priced at 100 µs a wrapped call (full) and
    200 µs (selective), nothing a forward op: the rows say so, from r50's 24 blocks and the measured kernel counts."""
    none = 638 * 1e-5
    timed = {"none": none, "full": 3 * none, "selective": 4 * none}
    monkeypatch.setattr(host_twin, "twin_seconds", lambda rounds: timed)
    regions = {"full": (1e-4, 0.0), "selective": (2e-4, 0.0)}
    monkeypatch.setattr(host_twin, "old_region_seconds", lambda modes: {mode: regions[mode] for mode in modes})
    rows = {row["variant"]: row for row in host_twin.measure(rounds=1)}
    assert [rows[variant]["this_cpu"] for variant in ("none", "full", "selective")] == ["1.000", "3.000", "4.000"]
    assert rows["full"]["priced_here"] == f"{(1170 * 1e-5 + 24 * 1e-4) / none:.3f}"
    assert rows["selective"]["priced_here"] == f"{(1118 * 1e-5 + 24 * 2e-4) / none:.3f}"
    assert rows[host_twin.PER_KERNEL]["this_cpu"] == "10.0"
    assert rows[host_twin.PER_KERNEL]["h200"] == f"{0.031590 / 638 * 1e6:.1f}"


def test_gpu_truths_host_rows_set_the_twin_beside_the_h200_and_the_ci_machine():
    truth_host = load_benchmark("gpu_truth.host")
    truth_device = load_benchmark("gpu_truth.device")
    rows = truth_host.twin_rows(truth_device.TruthDevice.detect(prefer_cuda=False), rounds=1)
    assert [row["variant"] for row in rows[:2]] == ["full", "selective"]
    assert all(row["ratio"] > 1 for row in rows[:2])  # recomputation costs the host on a tiny step
    committed = {
        row["variant"]: row for row in host_twin.read_rows(host_twin.Path(host_twin.__file__).with_suffix(".csv"))
    }
    assert f"H200 (r50 b32): {committed['full']['h200']}×" in rows[0]["note"]
    per_kernel = rows[2]
    assert per_kernel["seconds"] == pytest.approx(
        per_kernel["ratio"] * float(committed[host_twin.PER_KERNEL]["this_cpu"]) * 1e-6
    )


def test_the_summary_states_both_hosts_speeds_and_their_ratio(tmp_path):
    path = tmp_path / "twin.csv"
    rows = [
        ["none", "1.000", "1.000", "1.000"],
        ["full", "2.500", "2.800", "2.600"],
        ["selective", "3.600", "3.500", "3.500"],
        [host_twin.PER_KERNEL, "25.0", "50.0", "44.0"],
    ]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["variant", "this_cpu", "h200", "priced_here"])
        writer.writerows(rows)
    text = " ".join(host_twin.summary(path).split())
    assert "cost 2.500× (full), 3.600× (selective) of its unchecked step" in text
    assert "the H200's host-bound r50 step cost 2.800×, 3.500× (within 11%)" in text
    assert "the planner says 2.600×, 3.500× (within 4% of this CPU's)" in text
    assert "this CPU 25.0 µs on its twin (2.0×)" in text
    assert "| selective | 3.600 | 3.500 | 3.500 |" in host_twin.table(path)
