import csv
import multiprocessing
import sys

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger, Logger
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks import TrainingSummary
from lightning_memopt.callbacks.training_summary import _process_peak_rss_bytes, _reset_process_peak_rss, append_row
from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import quiet_trainer


def _fit(tmp_path, summary, max_steps=3, accelerator="cpu", **trainer_options):
    data = DataLoader(TensorDataset(torch.randn(24, 3, 32, 32), torch.arange(24) % 4), batch_size=6)
    trainer = quiet_trainer(
        accelerator=accelerator, max_steps=max_steps, callbacks=[summary], default_root_dir=tmp_path, **trainer_options
    )
    trainer.fit(FaceRecognitionModule(num_classes=4, backbone="iresnet_tiny"), data)
    return trainer


def test_summary_counts_steps_samples_and_reports_the_last_logged_loss(tmp_path, capsys):
    summary = TrainingSummary()
    trainer = _fit(tmp_path, summary)
    figures = summary.as_dict()
    assert figures["steps"] == 3 and figures["samples"] == 18
    assert figures["final_loss"] == pytest.approx(float(trainer.callback_metrics["train/loss"]))
    # the second batch's memory is counted on the CPU: its 6 samples are left out of the throughput
    assert figures["timed_samples"] == 12
    assert figures["samples_per_second"] == pytest.approx(12 / figures["train_seconds"])
    assert "memopt-train summary" not in "".join(capsys.readouterr())  # printing is asked for


def test_print_summary_prints_the_table(tmp_path, capsys):
    _fit(tmp_path, TrainingSummary(print_summary=True))
    printed = "".join(capsys.readouterr())
    assert "memopt-train summary" in printed and "optimizer steps   3" in printed


def test_the_figures_reach_a_csv_logger_at_fit_end(tmp_path):
    summary = TrainingSummary()
    trainer = _fit(tmp_path, summary, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    with next(tmp_path.glob("**/metrics.csv")).open() as handle:
        rows = list(csv.DictReader(handle))
    [row] = [row for row in rows if row.get("memopt/summary/steps")]
    assert rows[-1] is row and int(row["step"]) == 3  # after the train/loss rows of steps 0, 1, 2
    assert {key for key, value in row.items() if value} == {
        "step",
        "memopt/summary/steps",
        "memopt/summary/samples",
        "memopt/summary/samples_per_second",
        "memopt/summary/train_seconds",
        "memopt/summary/final_loss",
        "memopt/summary/peak_memory_bytes",
    }
    figures = summary.as_dict()
    assert float(row["memopt/summary/steps"]) == 3 and float(row["memopt/summary/samples"]) == 18
    assert float(row["memopt/summary/final_loss"]) == pytest.approx(float(trainer.callback_metrics["train/loss"]))
    assert float(row["memopt/summary/peak_memory_bytes"]) == figures["peak_memory_bytes"] > 0
    assert float(row["memopt/summary/samples_per_second"]) == pytest.approx(figures["samples_per_second"])


class _Recorder(Logger):
    """A logger that keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append((dict(metrics), step))


def test_every_logger_gets_the_figures_once_and_an_unknown_loss_is_left_out(tmp_path):
    loggers = [_Recorder(), _Recorder()]
    _fit(tmp_path, TrainingSummary(loss_key="no/such/key"), max_steps=2, logger=loggers, log_every_n_steps=1)
    for logger in loggers:
        summaries = [(metrics, step) for metrics, step in logger.calls if "memopt/summary/steps" in metrics]
        assert len(summaries) == 1
        metrics, step = summaries[0]
        assert step == 2 and metrics["memopt/summary/steps"] == 2
        assert "memopt/summary/final_loss" not in metrics


def test_off_cuda_the_peak_is_the_counted_batch_s_live_tensor_bytes_the_same_every_fit(tmp_path):
    first, second = TrainingSummary(), TrainingSummary()
    trainer = _fit(tmp_path, first)
    _fit(tmp_path, second)
    assert first.summary.peak_memory_source == "live tensor bytes of training batch 1 (MemoryTracker)"
    assert first.summary.peak_memory_bytes == second.summary.peak_memory_bytes
    model = trainer.lightning_module
    states = sum(t.numel() * t.element_size() for t in model.parameters()) * 2  # parameters and gradients
    states += sum(t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values())
    assert first.summary.peak_memory_bytes > states


def test_a_fit_that_ends_before_the_counted_batch_reports_the_process_peak(tmp_path):
    summary = TrainingSummary(memory_batch=5)
    _fit(tmp_path, summary, max_steps=2)
    assert "RSS" in summary.summary.peak_memory_source and summary.summary.peak_rss_bytes > 10 * 2**20
    assert summary.summary.peak_memory_bytes is None  # the tracker counted nothing: no tensor bytes reported
    assert summary.summary.timed_samples == summary.summary.samples == 12


def test_each_fit_appends_a_row_to_the_csv(tmp_path):
    path = tmp_path / "runs" / "grid.csv"
    _fit(tmp_path, TrainingSummary(csv_path=path, label="a=1"))
    _fit(tmp_path, TrainingSummary(csv_path=path, label="a=2"), max_steps=2)
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["label"], row["steps"]) for row in rows] == [("a=1", "3"), ("a=2", "2")]
    assert int(rows[0]["peak_memory_bytes"]) > 0 and float(rows[1]["samples_per_second"]) > 0


def test_a_csv_with_other_columns_is_refused_naming_the_file_and_both_column_lists(tmp_path):
    path = tmp_path / "grid.csv"
    path.write_text("label,loss\nx,1\n")
    message = (
        r"cannot append to '.*grid\.csv': it has the columns \['label', 'loss'\],"
        r" but the row has the columns \['label', 'steps'\]"
    )
    with pytest.raises(ValueError, match=message):
        append_row(path, {"label": "y", "steps": 1})
    assert path.read_text() == "label,loss\nx,1\n"  # untouched


def test_an_empty_file_gets_the_header_and_a_header_only_file_gets_rows(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.touch()
    append_row(empty, {"label": "a", "steps": 1})
    header_only = tmp_path / "header.csv"
    header_only.write_text("label,steps\r\n")
    append_row(header_only, {"label": "a", "steps": 1})
    for path in (empty, header_only):
        with path.open(newline="") as handle:
            assert list(csv.reader(handle)) == [["label", "steps"], ["a", "1"]]


_WRITERS = 8


def _append_at_the_barrier(barrier, path, index):
    barrier.wait()
    append_row(path, {"label": f"job {index}", "steps": index, "final_loss": index / 8, "note": 'a, "quoted" cell'})


def test_concurrent_processes_keep_every_row_and_write_one_header(tmp_path):
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    header = ["label", "steps", "final_loss", "note"]
    expected = sorted([f"job {i}", str(i), str(i / 8), 'a, "quoted" cell'] for i in range(_WRITERS))
    for trial in range(10):
        path = tmp_path / "sweep" / f"trial{trial}.csv"  # the folder does not exist yet: the writers race for it too
        barrier = context.Barrier(_WRITERS)
        writers = [
            context.Process(target=_append_at_the_barrier, args=(barrier, str(path), i)) for i in range(_WRITERS)
        ]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(timeout=60)
        assert [writer.exitcode for writer in writers] == [0] * _WRITERS
        with path.open(newline="") as handle:
            lines = list(csv.reader(handle))
        assert lines[0] == header and lines.count(header) == 1, f"trial {trial}: {lines}"
        assert sorted(lines[1:]) == expected, f"trial {trial}: {lines}"


def test_a_negative_memory_batch_is_refused():
    with pytest.raises(MisconfigurationException, match="`memory_batch`=-1 must be 0 or more"):
        TrainingSummary(memory_batch=-1)


def test_a_second_fit_starts_a_fresh_summary(tmp_path):
    summary = TrainingSummary()
    _fit(tmp_path, summary, max_steps=3)
    _fit(tmp_path, summary, max_steps=1)
    assert summary.summary.steps == 1 and summary.summary.samples == 6


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset is Linux-only")
def test_peak_rss_resets_between_fits():
    assert _reset_process_peak_rss()
    baseline = _process_peak_rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    raised = _process_peak_rss_bytes()
    del block
    assert raised - baseline > 48 * 2**20
    assert _reset_process_peak_rss()
    assert _process_peak_rss_bytes() < raised - 32 * 2**20


@pytest.mark.cuda
def test_on_a_gpu_the_peak_is_the_allocator_peak_of_this_fit(tmp_path):
    summary = TrainingSummary()
    _fit(tmp_path, summary, accelerator="gpu")
    assert summary.summary.peak_memory_source == "CUDA allocator peak"
    assert 0 < summary.summary.peak_memory_bytes == torch.cuda.max_memory_allocated()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"memory_batch": "abc"}, "TrainingSummary: `memory_batch` must be an integer, got 'abc' (str)"),
        ({"csv_path": "."}, "TrainingSummary: `csv_path`: '.' is a folder; give the path of a file"),
        ({"csv_path": 3}, "TrainingSummary: `csv_path` must be a path, got 3 (int)"),
        ({"print_summary": "maybe"}, "TrainingSummary: `print_summary` must be true or false, got 'maybe' (str)"),
    ],
)
def test_bad_arguments_are_refused_by_name_at_construction(options, message):
    with pytest.raises(MisconfigurationException) as error:
        TrainingSummary(**options)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("batch", "samples"),
    [
        ((torch.zeros(8, 3), torch.zeros(8)), 8),  # as micro-batching counts it
        ({"image": torch.zeros(8, 3), "lengths": torch.zeros(5)}, 8),  # lengths differ: the first tensor's
        ((torch.zeros(8, 3), torch.tensor(0.5)), 8),  # a 0-d tensor beside the batch
        (["no", "tensor"], 0),
    ],
)
def test_a_batch_counts_its_samples_even_where_it_cannot_be_split(batch, samples):
    from lightning_memopt.callbacks.training_summary import _samples_in

    assert _samples_in(batch) == samples
