import pytest
import torch
from torch import nn

from lightning_memopt.memory import CATEGORIES, MemoryTracker


def test_storages_are_counted_once_and_leave_when_they_die():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(1000)  # 4000 B
        view = a[10:20]  # shares a's storage
        b = a + 1  # a new 4000 B storage
        assert tracker.live_bytes == 8000
        del a, b
        assert tracker.live_bytes == 4000  # the view keeps a's storage alive
        del view
    assert tracker.live_bytes == 0 and tracker.peak.total_bytes == 8000


def test_exact_bytes_of_a_linear_layer_with_adam():
    layer = nn.Linear(100, 50)  # 5050 parameters = 20200 B
    optimizer = torch.optim.Adam(layer.parameters())
    x = torch.randn(4, 100)
    tracker = MemoryTracker()
    tracker.track_module(layer)
    tracker.track([x], "inputs")
    with tracker:
        with tracker.in_phase("forward"):
            loss = layer(x).square().mean()
        with tracker.in_phase("backward"):
            loss.backward()
        tracker.relabel_gradients(layer)
        with tracker.in_phase("optimizer"):
            optimizer.step()
        tracker.relabel_optimizer_state(optimizer)
    totals = tracker.current().by_category()
    assert totals["parameters"] == 5050 * 4
    assert totals["gradients"] == 5050 * 4
    # exp_avg + exp_avg_sq for weight and bias, plus a 4-byte fp32 `step` tensor per parameter
    assert totals["optimizer_state"] == 2 * 5050 * 4 + 2 * 4
    assert totals["inputs"] == 4 * 100 * 4


def test_peak_breakdown_names_the_forward_activations_by_top_level_module():
    model = nn.Sequential()
    model.add_module("wide", nn.Linear(10, 1000))
    model.add_module("narrow", nn.Linear(1000, 10))
    tracker = MemoryTracker()
    tracker.track_module(model)
    with tracker, tracker.in_phase("forward"):
        out = model(torch.randn(8, 10))
    tracker.remove_hooks()
    by_module = tracker.peak.activations_by_module()
    assert by_module["wide"] == 8 * 1000 * 4
    assert by_module["narrow"] == 8 * 10 * 4
    assert tracker.peak.phase == "forward"
    assert out.shape == (8, 10)


def test_rounding_mimics_allocator_blocks():
    tracker = MemoryTracker(round_to=512)
    with tracker:
        x = torch.zeros(3)  # 12 B → one 512 B block
    assert tracker.live_bytes == 512 and x.numel() == 3


def test_reset_peak_starts_from_what_is_live():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(100)
        b = torch.zeros(100)
        del b
        tracker.reset_peak()
        assert tracker.peak.total_bytes == 400
    assert a.numel() == 100


def test_timeline_records_every_change():
    tracker = MemoryTracker(record_timeline=True)
    with tracker:
        a = torch.zeros(10)
        del a
    assert [bytes_ for _, bytes_, _ in tracker.timeline] == [40, 0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.track([torch.zeros(1)], "weights"), r"Unknown `category`='weights'; valid choices: parameters"),
        (lambda t: t.in_phase("warmup").__enter__(), r"Unknown `phase`='warmup'; valid choices: setup, forward"),
        (lambda t: MemoryTracker(round_to=0), r"`round_to`=0 must be at least 1"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(MemoryTracker())


def test_categories_are_the_documented_ones():
    assert CATEGORIES == ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")


def test_a_storage_resized_in_place_counts_at_its_size_and_grown_back_as_gathered_parameters():
    tracker = MemoryTracker()
    with tracker:
        unit = torch.empty(256)  # 1 KiB, as FSDP allocates a unit's gathered parameters
        unit.untyped_storage().resize_(0)  # freed after the unit's forward
        assert tracker.live_bytes == 0
        unit.untyped_storage().resize_(1024)  # gathered again for its backward
        assert tracker.live_bytes == 1024
        (record,) = tracker.current().records
        assert (record.category, record.op) == ("parameters", "gathered parameters")
    assert tracker.peak.total_bytes == 1024
    unit.untyped_storage().resize_(0)  # outside the tracker: torch's own resize again
    assert tracker.live_bytes == 1024 and "resize_" not in torch.UntypedStorage.__dict__


def test_each_phase_keeps_its_peak_and_its_peak_of_bytes_other_than_gradients():
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 64))
    tracker = MemoryTracker()
    tracker.track_module(model)
    tracker.label_gradients_on_arrival(model)
    with tracker:
        with tracker.in_phase("forward"):
            loss = model(torch.randn(32, 64)).square().mean()
        with tracker.in_phase("backward"):
            loss.backward()
    tracker.remove_hooks()
    peak = tracker.phase_peak("backward").by_category()
    lean = tracker.phase_peak("backward", less_gradients=True).by_category()
    assert peak["gradients"] == peak["parameters"]  # the most bytes: once every gradient arrived
    assert lean["gradients"] < peak["gradients"]  # the most other bytes: before the first layer's gradients
    assert sum(lean.values()) - lean["gradients"] > sum(peak.values()) - peak["gradients"]
    assert tracker.phase_peaks["backward"] == sum(peak.values())


def test_autocast_copies_of_parameters_are_named_as_such():
    layer = nn.Linear(64, 64)
    tracker = MemoryTracker()
    tracker.track_module(layer)
    with tracker, tracker.in_phase("forward"), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        out = layer(torch.randn(8, 64, requires_grad=True))
    casts = [r for r in tracker.current().records if r.op == "parameter cast"]  # the bias's copy is gone already
    assert [(r.shape, r.dtype) for r in casts] == [((64, 64), torch.bfloat16)]  # kept for the input's gradient
    assert out.dtype == torch.bfloat16


def test_host_parameters_take_their_gradients_and_optimizer_state_to_the_host():
    layer = nn.Linear(100, 50, bias=False)  # 20000 B
    optimizer = torch.optim.SGD(layer.parameters(), momentum=0.9)
    tracker = MemoryTracker()
    tracker.track(layer.parameters(), "parameters", host=True)  # CPU-offloaded shards
    with tracker:
        with tracker.in_phase("backward"):
            layer(torch.randn(4, 100)).sum().backward()
        tracker.relabel_gradients(layer)
        with tracker.in_phase("optimizer"):
            optimizer.step()
        tracker.relabel_optimizer_state(optimizer)
        assert tracker.host_breakdown() == {**dict.fromkeys(CATEGORIES, 0), "parameters": 20000,
                                            "gradients": 20000, "optimizer_state": 20000}  # fmt: skip
        assert tracker.live_bytes == 0
