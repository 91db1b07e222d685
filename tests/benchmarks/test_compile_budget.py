"""benchmarks/claims/compile_budget.py: the allocator-level instrument, and its quick run against torch.compile's
budget."""

import csv
import math

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.models import create_model
from tests.helpers import load_benchmark

compile_budget = load_benchmark("claims.compile_budget")


def _both_counts(build, batch):
    """(allocator peak, tracker peak) of one forward + backward of the model ``build()`` makes, on ``batch``."""
    model = compile_budget._built(build)
    variant = compile_budget.Variant("eager", model, model)
    variant.step(batch)  # a first step: lazy state (oneDNN's, autograd's) is not the step's
    measured = compile_budget.allocator_peak(lambda: variant.forward(batch))
    return measured, compile_budget.tracker_peak(model, batch)


def test_the_allocator_counts_a_step_as_the_tracker_does():
    """Without op-internal buffers the two instruments agree to the byte: a stack of two ViT blocks."""
    torch.manual_seed(0)
    measured, tracked = _both_counts(
        lambda: nn.Sequential(*create_model("sapiens_tiny").backbone.blocks), (torch.randn(2, 12, 64),)
    )
    assert measured.peak == tracked > 0
    assert 0 < measured.after_forward <= measured.peak


def test_the_allocator_also_sees_what_no_tensor_holds():
    """A convolution's backward takes a workspace from the allocator that is no tensor: the allocator counts it, the
    tracker cannot; everything the tracker counts the allocator counts too."""
    measured, tracked = _both_counts(lambda: create_model("sapiens_tiny"), (torch.randn(2, 3, 64, 48),))
    assert tracked <= measured.peak <= 1.25 * tracked


def test_offloaded_copies_are_host_memory_as_the_tracker_counts_them():
    """The copies an ``offload`` block makes are counted apart, as the tracker's host bytes, and not in the peak."""
    batch = (torch.randn(2, 3, 64, 48),)

    def offloaded():
        model = create_model("sapiens_tiny")
        apply_activation_checkpointing(model, "offload")
        return model

    model = compile_budget._built(offloaded)
    variant = compile_budget.Variant("ours", model, model)
    variant.step(batch)
    measured = compile_budget.allocator_peak(lambda: variant.forward(batch))
    tracker = MemoryTracker()
    with tracker:
        tracker.track_module(model)
        tracker.track(list(batch), "inputs")
        variant.step(batch)
    tracker.remove_hooks()
    unchecked, _ = _both_counts(lambda: create_model("sapiens_tiny"), batch)
    assert measured.host == tracker.peak_host_bytes > 0
    assert measured.peak < unchecked.peak <= measured.ram_peak


def test_the_allocator_sees_inside_a_compiled_step():
    """What a compiled forward saves for its backward (the partitioner's own count) is held when its backward
    starts, and the budget reached the partitioner."""
    torch._dynamo.reset()

    def build():
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    batch = (torch.randn(32, 64),)
    variant = compile_budget.compiled_variant(build, batch, "aot_eager_decomp_partition", 0.5)
    weights = [parameter.nbytes for parameter in variant.model.parameters()]
    measured = compile_budget.allocator_peak(lambda: variant.forward(batch), weights)
    torch._dynamo.reset()
    assert variant.budgets_seen == [0.5]
    assert 0 < variant.saved_bytes <= measured.after_forward <= measured.peak
    assert 0 < measured.gradient_sized <= sum(weights)  # the compiled backward's weight gradients


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile_budget") / "compile_budget.csv"
    rows = compile_budget.main(["--quick", "--only", "sapiens_0.3b", "--csv", str(path)])
    return rows, path


def test_the_quick_run_compares_ours_with_compiles_budget(quick_rows):
    rows, path = quick_rows
    reference, budgeted = rows
    assert [row["budget"] for row in rows] == [1.0, 0.4]
    for row in rows:
        for key in (
            "our_peak_mib",
            "our_after_forward_mib",
            "our_ram_peak_mib",
            "aot_eager_peak_mib",
            "aot_eager_saved_mib",
            "aot_eager_gradient_sized_mib",
        ):
            assert row[key] > 0, key
        assert row["our_seconds"] > 0 and row["aot_eager_seconds"] > 0
        assert row["aot_eager_graphs"] >= 1
        assert row["aot_eager_partitioner_budgets"] == f"{row['budget']:g}"
        # the host copies are counted apart from the peak, and only where ours offloads: all of RAM at once is at
        # least the device's peak and at most that peak plus the most host copies held at once
        assert (row["our_host_mib"] > 0) == ("offload" in row["our_modes"])
        assert row["our_peak_mib"] <= row["our_ram_peak_mib"] <= row["our_peak_mib"] + row["our_host_mib"] + 1e-9
        assert math.isnan(row["inductor_peak_mib"])  # --quick compiles with aot_eager only
    assert budgeted["our_modes"] != "none"
    assert budgeted["our_peak_mib"] < reference["our_peak_mib"]
    assert budgeted["our_estimate_mib"] < budgeted["our_unchecked_estimate_mib"]
    assert reference["our_estimate_mib"] == budgeted["our_unchecked_estimate_mib"]
    assert budgeted["aot_eager_saved_mib"] < reference["aot_eager_saved_mib"]
    with path.open() as handle:
        assert len(list(csv.DictReader(handle))) == 2


def test_the_docs_table_renders_from_the_csv(quick_rows):
    _, path = quick_rows
    lines = compile_budget.table(path).splitlines()
    assert lines[0].startswith("| model | budget | ours: blocks |")
    assert len(lines) == 4
    assert "–" in lines[3]  # the inductor cells of a --quick run
