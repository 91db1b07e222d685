"""benchmarks/gpu_truth/ (run as benchmarks/gpu_truth.py): the dry run end to end, its rows and exit code, the device
it measures on (CPU, CUDA)."""

import csv
import doctest
import math
import sys

import pytest
import torch

from lightning_memopt.planner.space import DEFAULT_SAFETY_MARGIN
from tests.helpers import BENCHMARKS, load_benchmark, run_script

gpu_truth = load_benchmark("gpu_truth.harness")
# the package's modules, as loaded with it (held here: other tests' fixtures clear the benchmarks out of sys.modules)
SIBLINGS = {
    name: sys.modules[f"gpu_truth.{name}"]
    for name in (
        "allocator", "cases", "device", "host", "memory", "peak_trace", "recovery", "rows", "reference", "runtime",
        "seeds",
    )
}  # fmt: skip
truth_device, truth_memory, truth_recovery, truth_rows, truth_seeds = (
    SIBLINGS[name] for name in ("device", "memory", "recovery", "rows", "seeds")
)
SECTIONS = [  # in the order they run: the timings first
    "device",
    "step time",
    "host",
    "monitor",
    "oom recovery",
    "overflow",
    "prediction",
    "reference batch",
    "smallest device",
    "calibration",
    "seeds",
    "allocator",
    "planner",
    "cuda tests",
]


@pytest.mark.slow
def test_the_dry_run_measures_every_section_and_every_check_passes(tmp_path):
    done = run_script(BENCHMARKS / "gpu_truth.py", ["--dry-run", "--csv", str(tmp_path / "truth.csv")], tmp_path, 900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (tmp_path / "truth.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(dict.fromkeys(r["section"] for r in rows)) == SECTIONS
    predictions = [r for r in rows if r["section"] == "prediction"]
    assert len(predictions) == 3 * 4  # three tiny presets × fp32 / bf16-mixed × none / full
    assert all(abs(float(r["deviation"])) <= 0.10 and r["passed"] == "yes" for r in predictions)
    assert all(r["passed"] in ("yes", "") for r in rows)
    by_section = {r["section"]: r for r in rows}
    assert "1 OOM recovered" in by_section["oom recovery"]["note"]
    assert float(by_section["overflow"]["ratio"]) == 0.5  # the loss scale halved
    assert "skipped" in by_section["cuda tests"]["note"]  # no CUDA here: every cuda test skips
    assert {r["variant"] for r in rows if r["section"] == "step time"} >= {"none", "selective", "full", "offload"}
    assert (tmp_path / "truth.md").read_text() == gpu_truth.document(rows) + "\n"
    assert 0 <= float(by_section["calibration"]["ratio"]) < 0.1  # the tracker's peaks are the predictions'
    reference = [r for r in rows if r["section"] == "reference batch"]
    assert len(reference) == 3 * 2 and all(r["passed"] == "yes" for r in reference)  # three tiny presets × 2
    allocator = [r for r in rows if r["section"] == "allocator"]
    assert [r["variant"] for r in allocator] == ["32-true, default", "32-true, expandable_segments:True"]
    assert allocator[0]["allocated_mib"] == allocator[1]["allocated_mib"]  # the same step, counted the same
    seeds = [r for r in rows if r["section"] == "seeds"]
    assert [r["variant"].split(":")[0] for r in seeds] == [f"planned for {name}" for name in
                                                            ("rtx3090_24gb", "a800_80gb", "v100_32gb")]  # fmt: skip
    assert all(r["passed"] == "yes" and float(r["allocated_mib"]) > 0 for r in seeds)
    assert "0 of 27 checks failed" in done.stdout


@pytest.mark.parametrize(("passed", "code"), [(True, 0), (False, 1)])
def test_a_failed_check_makes_the_exit_code_1(monkeypatch, tmp_path, capsys, passed, code):
    def measure(device, suite, workers, deadline, keep):
        rows = [
            gpu_truth.device_row(device, suite),
            truth_rows.row("prediction", "r50", "32-true", deviation=0.2 if not passed else 0.0, passed=passed),
        ]
        keep(rows)  # as each section does
        return rows

    monkeypatch.setattr(gpu_truth, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["gpu_truth.py", "--dry-run", "--csv", str(tmp_path / "t.csv")])
    assert gpu_truth.main() == code
    assert (tmp_path / "t.csv").exists() and (tmp_path / "t.md").exists()
    captured = capsys.readouterr()
    assert (f"{0 if passed else 1} of 1 checks failed") in captured.out
    assert ("FAILED prediction: r50, 32-true" in captured.err) == (not passed)


def test_no_section_starts_past_the_deadline_and_each_one_left_out_is_a_row(capsys):
    device = truth_device.TruthDevice.detect(prefer_cuda=False)
    kept = []
    rows = gpu_truth.measure(device, "dry", 1, deadline=0.0, keep=lambda so_far: kept.append(len(so_far)))
    sections = [line["section"] for line in rows[1:]]
    assert sections[:5] == ["step time", "host", "monitor", "oom recovery", "overflow"]  # timings before any worker
    assert len(sections) == 13 and {line["variant"] for line in rows[1:]} == {"past --deadline"}
    assert kept == list(range(2, 15))  # the CSV is written again after each section
    assert "skip cuda tests" in capsys.readouterr().out


def test_a_section_that_raises_is_a_failed_row_and_the_run_goes_on(capsys):
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access\nmore lines")

    assert gpu_truth.run_section("overflow", broken) == [
        truth_rows.row(
            "overflow", "the section failed", "RuntimeError", passed=False, note="CUDA error: an illegal memory access"
        )  # fmt: skip
    ]
    captured = capsys.readouterr()
    assert "Traceback" in captured.err and "FAIL overflow" in captured.out
    fine = [truth_rows.row("overflow", "r50", "16-mixed", ratio=0.5, passed=True)]
    assert gpu_truth.run_section("overflow", lambda: fine) == fine


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for --dry-run only where there is no CUDA device")
def test_without_cuda_it_asks_for_the_dry_run(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_truth.py"])
    with pytest.raises(SystemExit) as info:
        gpu_truth.main()
    assert info.value.code == 2
    assert (
        "no CUDA device here: run it on a GPU machine, or check the code path with --dry-run" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--dry-run", "--workers", "0"], "--workers=0 must be at least 1"),
        (["--table", "--csv", "missing.csv"], "--table: no CSV at missing.csv; give --csv the one a run wrote"),
    ],
)
def test_bad_arguments_are_refused(monkeypatch, capsys, arguments, message):
    monkeypatch.setattr(sys, "argv", ["gpu_truth.py", *arguments])
    with pytest.raises(SystemExit):
        gpu_truth.main()
    assert message in capsys.readouterr().err


def test_the_table_is_printed_from_a_csv(monkeypatch, tmp_path, capsys):
    rows = [gpu_truth.device_row(truth_device.TruthDevice.detect(prefer_cuda=False), "dry"),
            truth_rows.row("step time", "r50", "full", seconds=0.5, ratio=1.25)]  # fmt: skip
    gpu_truth.write_csv(tmp_path / "t.csv", rows)
    capsys.readouterr()  # "wrote …"
    monkeypatch.setattr(sys, "argv", ["gpu_truth.py", "--table", "--csv", str(tmp_path / "t.csv")])
    assert gpu_truth.main() == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Measured on CPU (") and "| r50 | full | 0.5000 | 1.250 |" in printed


def test_the_markdown_has_a_table_per_section_with_the_columns_it_fills():
    rows = [
        truth_rows.row(
            "prediction", "r50", "fp32", predicted=2**20, peak=truth_device.Peak(2**21), deviation=-0.5, passed=True
        ),  # fmt: skip
        truth_rows.row("step time", "r50", "full", seconds=0.5, ratio=1.25),
    ]
    text = truth_rows.markdown(rows)
    assert text.split("\n\n")[0] == "**prediction**"
    assert "| r50 | fp32 | 1.0 | 2.0 | 0.500 | yes |" in text
    assert "reserved MiB" not in text  # no row has reserved bytes (none off CUDA): no such column
    assert "| case | variant | seconds | ratio |" in text and "| r50 | full | 0.5000 | 1.250 |" in text
    assert truth_rows.failed(rows) == [] and truth_rows.failed([{**rows[0], "passed": "no"}]) == [
        {**rows[0], "passed": "no"}
    ]


def test_the_safety_margin_covers_the_smallest_device_each_step_runs_on():
    total, context = 1000, 10  # MiB: the device, its CUDA context
    ratios = []
    for predicted, least in ((100, 100), (100, 140)):  # MiB: predicted, the least memory the step ran on
        needed = 1 - predicted / least * (1 - context / total)
        ratios.append(truth_rows.row("smallest device", "c", "fp32", predicted=predicted * 2**20, ratio=needed))
    calibration = truth_memory.margin_row(ratios)
    assert calibration["ratio"] == pytest.approx(1 - 0.99 / 1.4) and calibration["ratio"] > DEFAULT_SAFETY_MARGIN
    assert calibration["passed"] == "no"
    # a plan at the margin predicts (1 − m) T; the step then holds 1.4× that beside the context: exactly full
    planned = (1 - calibration["ratio"]) * total
    assert planned * 1.4 + context == pytest.approx(total)
    assert truth_memory.margin_row(ratios[:1])["passed"] == "yes"


def test_a_row_whose_prediction_missed_is_named_and_left_to_its_own_check():
    smallest = [
        truth_rows.row("smallest device", "r50", "bf16-mixed, checkpointing preset", ratio=0.12),
        truth_rows.row("smallest device", "cotracker3", "bf16-mixed, checkpointing preset", ratio=0.215),
    ]
    predictions = [
        truth_rows.row("prediction", "r50", "bf16-mixed, checkpointing preset", passed=True),
        truth_rows.row("prediction", "cotracker3", "bf16-mixed, checkpointing preset", passed=False),
    ]
    calibration = truth_memory.margin_row(smallest, predictions)
    assert calibration["ratio"] == 0.12 and calibration["passed"] == ("yes" if DEFAULT_SAFETY_MARGIN >= 0.12 else "no")
    assert (
        "left out (prediction more than 5 % off): cotracker3 bf16-mixed, checkpointing preset needs 0.215"
        in (calibration["note"])
    )
    assert truth_memory.margin_row(smallest)["ratio"] == 0.215  # without prediction rows every row counts


def test_the_smallest_device_is_bisected_from_real_out_of_memory_errors(monkeypatch):
    device = truth_device.TruthDevice.detect(prefer_cuda=False)
    runs = []

    def measured(device, case, precision, policy, cap=None):  # a step that needs 700 bytes
        runs.append(cap)
        if cap < 700:
            raise torch.OutOfMemoryError("simulated")
        return truth_device.Peak(700), 0

    monkeypatch.setattr(truth_memory, "measured_peak", measured)
    least = truth_memory.smallest_cap(device, None, "32-true", None, 500, 600)  # 600 is too little: doubled
    assert runs[0] == 600 and runs[1] == 1200 and 700 <= least <= 700 + (1200 - 600) / 32


def test_gradients_are_compared_by_the_norm_of_their_difference():
    ours, reference = [torch.tensor([1.0, 1.0])], [torch.tensor([1.0, 2.0])]
    assert truth_recovery.relative_difference(ours, reference) == pytest.approx(1 / math.sqrt(5))
    with pytest.raises(ValueError):  # a missing tensor is no match
        truth_recovery.relative_difference(ours, reference * 2)


def test_a_seed_whose_gpu_has_more_memory_than_the_device_is_not_run_and_says_why():
    from types import SimpleNamespace

    h100 = SimpleNamespace(is_cuda=True, total_bytes=int(79.1 * 2**30), context_bytes=500 * 2**20, name="NVIDIA H100")
    sapiens, cotracker = truth_seeds.SEEDS["full"][1], truth_seeds.SEEDS["full"][0]
    assert not truth_seeds.runs_here(h100, sapiens) and truth_seeds.runs_here(h100, cotracker)
    line = truth_seeds.seed_row(h100, sapiens, None)
    assert line["passed"] == "" and line["note"].startswith("cannot run here: a800_80gb has 80.0 GiB, NVIDIA H100 78.6")


def test_the_recovery_check_runs_without_random_layers():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3), torch.nn.Dropout2d(0.1))
    assert truth_recovery.without_random_layers(module) == ["1", "2"]
    assert module[1].p == 0.0 and module[2].p == 0.0


def test_the_cpu_device_measures_the_tracker_and_caps_with_a_simulated_device():
    device = truth_device.TruthDevice.detect(prefer_cuda=False)
    assert not device.is_cuda and device.total_bytes > 0 and device.context_bytes == 0
    with device.peaks() as peak:
        kept = torch.zeros(1024)
        del kept
        torch.zeros(512)
    assert peak.allocated == 4096 and math.isnan(peak.reserved)
    with pytest.raises(torch.OutOfMemoryError), device.capped(4096):
        torch.zeros(2048)


@pytest.mark.cuda
def test_the_cuda_device_reads_the_allocator_and_caps_it_for_real():
    device = truth_device.TruthDevice.detect()
    assert device.is_cuda and device.context_bytes > 0 and "CUDA" in device.driver
    device.release()
    with device.peaks() as peak:
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device.device)
        del block
    assert peak.allocated >= 64 * 2**20 and peak.reserved >= peak.allocated
    with pytest.raises(torch.OutOfMemoryError), device.capped(torch.cuda.memory_reserved() + 256 * 2**20):
        torch.empty(2**30, dtype=torch.uint8, device=device.device)
    torch.empty(2**30, dtype=torch.uint8, device=device.device)  # the cap is gone with the block


@pytest.mark.parametrize("name", sorted(SIBLINGS))
def test_the_examples_in_the_docstrings_run(name):
    result = doctest.testmod(SIBLINGS[name])
    assert result.attempted > 0 and result.failed == 0
