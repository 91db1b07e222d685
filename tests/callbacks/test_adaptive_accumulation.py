from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_memopt.accumulation.training as recovery_module
from lightning_memopt import AdaptiveAccumulation, PrecisionSwitch
from lightning_memopt.accumulation import MicroBatchSizeError, RanksOutOfStepError, SampleOutOfMemoryError
from lightning_memopt.memory import MemoryTracker, SimulatedDevice
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.accumulation.test_micro_batch_runner import FailInBackward, injected_oom
from tests.helpers import quiet_trainer, run_ranks, run_script

SAMPLES = 64


class OOMToy(pl.LightningModule):
    """Regression on (x, y, sample id) whose steps run out of memory past a micro-batch size.

    ``forward_limit`` / ``backward_limit`` make a training forward / backward fail for more samples
    than that; ``eval_limit`` does the same in validation, test and predict. ``fail_rank`` limits the
    failures to one rank, ``fail_from`` / ``fail_until`` to the steps from / before them. ``counter``
    holds one parameter per sample whose gradient counts how often the sample reached the optimizer step.
    """

    def __init__(
        self,
        forward_limit=None,
        backward_limit=None,
        eval_limit=None,
        fail_rank=None,
        fail_until=None,
        fail_from=None,
        batchnorm=False,
        batch_size=16,
        hidden=16,
        optimizer="adam",
        scratch=0,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, hidden)
        self.norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.second = nn.Linear(hidden, 1)
        self.optimizer = optimizer
        self.scratch = scratch  # floats per sample a training step allocates on top
        self.counter = nn.Embedding(SAMPLES, 1)
        nn.init.zeros_(self.counter.weight)
        self.forward_limit, self.backward_limit, self.eval_limit = forward_limit, backward_limit, eval_limit
        self.fail_rank, self.fail_from, self.fail_until = fail_rank, fail_from, fail_until
        self.batch_size = batch_size
        self.val_mse = torchmetrics.MeanSquaredError()
        self.counts = []  # the counter's gradient at each optimizer step, in samples

    def failing(self, limit, samples):
        if limit is None or samples <= limit or (self.fail_rank is not None and self.global_rank != self.fail_rank):
            return False
        if self._trainer is None:
            return True
        step = self.trainer.global_step
        started = self.fail_from is None or step >= self.fail_from
        return started and (self.fail_until is None or step < self.fail_until)

    def forward(self, x, backward_limit=None):
        hidden = torch.tanh(self.norm(self.first(x)))
        if backward_limit is not None:
            hidden = FailInBackward.apply(hidden, backward_limit)
        return self.second(hidden).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        if self.failing(self.forward_limit, len(x)):
            raise injected_oom()
        prediction = self(x, self.backward_limit if self.failing(self.backward_limit, len(x)) else None)
        loss = (prediction - y).pow(2).mean() + self.counter(ids).mean()
        if self.scratch:
            loss = loss + x.new_zeros(len(x), self.scratch).sum() * 0
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        samples = self.batch_size * self.trainer.accumulate_grad_batches
        self.counts.append((self.counter.weight.grad.squeeze(1) * samples).detach().clone())

    def evaluate(self, batch, stage):
        x, y, _ = batch
        if self.failing(self.eval_limit, len(x)):
            raise injected_oom()
        prediction = self(x)
        self.val_mse.update(prediction, y)
        self.log(f"{stage}/loss", (prediction - y).pow(2).mean())
        self.log(f"{stage}/mse", self.val_mse)
        return {"prediction": prediction}

    def validation_step(self, batch, batch_idx):
        return self.evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self.evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        x, _, _ = batch
        if self.failing(self.eval_limit, len(x)):
            raise injected_oom()
        return self(x)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(SAMPLES, 8, generator=generator),
            torch.randn(SAMPLES, generator=generator),
            torch.arange(SAMPLES),
        )
        return DataLoader(data, batch_size=self.batch_size)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = dataloader


def fit(module, callbacks=(), max_steps=6, **options):
    options = {"limit_val_batches": 0, **options}
    ckpt_path = options.pop("ckpt_path", None)
    trainer = quiet_trainer(max_steps=max_steps, callbacks=list(callbacks), **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def relative_error(a, b):
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("fault", ["forward_limit", "backward_limit"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_recovered_run_equals_the_unconstrained_one(fault, accumulate):
    reference = OOMToy()
    fit(reference, accumulate_grad_batches=accumulate)
    module, callback = OOMToy(**{fault: 5}), AdaptiveAccumulation()
    trainer = fit(module, [callback], accumulate_grad_batches=accumulate)
    assert relative_error(module, reference) < 1e-6
    assert trainer.global_step == 6 and len(module.counts) == 6
    assert callback.sizer.size == 4 and callback.sizer.oom_recoveries == 1


def test_every_sample_counted_once_per_optimizer_step():
    module = OOMToy(backward_limit=3)
    fit(module, [AdaptiveAccumulation()], max_steps=4, accumulate_grad_batches=2)
    for step, counts in enumerate(module.counts):
        expected = torch.zeros(SAMPLES)
        start = step % 2 * 32  # an epoch is two steps of two batches of 16
        expected[start : start + 32] = 1.0  # each sample once
        torch.testing.assert_close(counts, expected, rtol=0, atol=1e-6)


def test_a_simulated_device_forces_the_recovery():
    def peak(micro_batch_size):
        module = OOMToy(batch_size=32, hidden=4096)  # activations well above everything else
        tracker = MemoryTracker()
        with tracker:
            fit(module, [AdaptiveAccumulation(micro_batch_size)], max_steps=2)
        return tracker.peak.total_bytes

    whole, half = peak(None), peak(16)
    assert half < whole
    reference = OOMToy(batch_size=32, hidden=4096)
    fit(reference, max_steps=2)
    module, callback = OOMToy(batch_size=32, hidden=4096), AdaptiveAccumulation()
    with SimulatedDevice((whole + half) // 2) as device:
        fit(module, [callback], max_steps=2)
    assert device.oom_count >= 1 and callback.sizer.size == 16
    assert relative_error(module, reference) < 1e-6


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16-mixed", 1e-2), ("switch-16", 1e-3)])
def test_mixed_precision_and_the_gradient_scaler(precision, tolerance):
    # Lightning turns 16-mixed into bf16-mixed on a CPU; PrecisionSwitch runs fp16 with a GradScaler here
    def run(module, callbacks):
        if precision == "switch-16":
            return fit(module, [PrecisionSwitch("16-mixed"), *callbacks], max_steps=4)
        return fit(module, callbacks, max_steps=4, precision=precision)

    reference = OOMToy(optimizer="sgd")
    run(reference, [])
    module = OOMToy(backward_limit=5, optimizer="sgd")
    trainer = run(module, [AdaptiveAccumulation()])
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert (scaler is not None) == (precision != "bf16-mixed")
    # half-precision matmuls over other row counts; an unscaled micro-batch would be off by 2**16
    assert relative_error(module, reference) < tolerance


def test_resume_keeps_the_micro_batch_size(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    first = AdaptiveAccumulation(grow_after=100)
    fit(OOMToy(forward_limit=5), [first, checkpoint], max_steps=2, enable_checkpointing=True)
    assert first.sizer.size == 4
    module, resumed = OOMToy(), AdaptiveAccumulation(grow_after=100)  # no failures any more
    seen = []
    module.on_train_batch_end = lambda *args: seen.append(resumed.last_micro_batch_size)
    fit(module, [resumed], max_steps=4, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert seen == [4, 4] and resumed.sizer.oom_recoveries == 1


def test_grows_back_when_the_pressure_is_gone():
    callback = AdaptiveAccumulation(grow_after=2)
    module = OOMToy(forward_limit=5, fail_until=1)
    sizes = []
    module.on_train_batch_end = lambda *args: sizes.append(callback.last_micro_batch_size)
    fit(module, [callback], max_steps=6)
    assert sizes == [4, 4, 8, 8, 16, 16]
    assert callback.sizer.size is None


def test_allocator_thrashing_shrinks_the_micro_batch(monkeypatch):
    retries = iter(range(100))
    monkeypatch.setattr(recovery_module, "allocator_retries", lambda device: next(retries))
    reference, module = OOMToy(), OOMToy()
    fit(reference)
    callback = AdaptiveAccumulation(thrash_steps=2)
    sizes = []
    module.on_train_batch_end = lambda *args: sizes.append(callback.last_micro_batch_size)
    fit(module, [callback])
    assert sizes == [16, 16, 8, 8, 4, 4] and callback.sizer.preemptive_shrinks == 3  # the third after batch 5
    assert relative_error(module, reference) < 1e-6


def test_logs_the_size_and_the_recoveries():
    trainer = fit(OOMToy(forward_limit=9), [AdaptiveAccumulation()], max_steps=2)
    assert trainer.callback_metrics["memopt/micro_batch_size"].item() == 8
    assert trainer.callback_metrics["memopt/oom_recoveries"].item() == 1


def test_batch_norm_gets_one_warning():
    with pytest.warns(UserWarning, match="micro-batches of 4 \\(of 16\\) change the batch statistics") as record:
        fit(OOMToy(forward_limit=5, batchnorm=True), [AdaptiveAccumulation()], max_steps=3)
    assert sum("batch statistics" in str(w.message) for w in record) == 1


def test_one_sample_that_does_not_fit_reports_its_profile():
    module = OOMToy(scratch=2**20)  # 4 MiB per sample
    with pytest.raises(SampleOutOfMemoryError, match="one sample does not fit") as info, SimulatedDevice(3 * 2**20):
        fit(module, [AdaptiveAccumulation()], max_steps=1)
    assert info.value.profile is not None and info.value.profile.peak_bytes > 0
    assert info.value.profile.peak_bytes > 4 * 2**20  # the scratch tensor of the one sample
    assert "predicted in fake mode" in str(info.value) and "temporaries" in str(info.value)


def test_evaluation_in_chunks_gives_identical_metrics():
    def evaluate(module, callbacks):
        trainer = quiet_trainer(callbacks=callbacks)
        validation = trainer.validate(module, verbose=False)[0]
        test = trainer.test(module, verbose=False)[0]
        predictions = torch.cat(trainer.predict(module))
        return validation, test, predictions

    # batches of 10 (the last of 4) in uneven chunks: 10 → 5 → 3 → [3, 2], then 3, 2, ...
    reference = evaluate(OOMToy(batch_size=10), [])
    callback = AdaptiveAccumulation()
    chunked = evaluate(OOMToy(batch_size=10, eval_limit=3), [callback])
    assert set(chunked[0]) == {"val/loss", "val/mse"} and set(chunked[1]) == {"test/loss", "test/mse"}
    assert chunked[0] == pytest.approx(reference[0], rel=1e-6) and chunked[1] == pytest.approx(reference[1], rel=1e-6)
    torch.testing.assert_close(chunked[2], reference[2])
    assert callback.eval_micro_batch_size == 3


def test_epoch_means_weigh_micro_batches_by_their_size():
    reference = fit(OOMToy(batch_size=10), max_steps=7)  # a whole epoch: six batches of 10, one of 4
    trainer = fit(OOMToy(batch_size=10, forward_limit=4), [AdaptiveAccumulation()], max_steps=7)
    expected = reference.callback_metrics["train/loss_epoch"].item()
    assert trainer.callback_metrics["train/loss_epoch"].item() == pytest.approx(expected, rel=1e-6)


def test_validation_during_fit_is_chunked_too():
    trainer = fit(
        OOMToy(eval_limit=3), [AdaptiveAccumulation()], max_steps=2, limit_val_batches=2, val_check_interval=2
    )
    reference = fit(OOMToy(), max_steps=2, limit_val_batches=2, val_check_interval=2)
    assert trainer.callback_metrics["val/mse"].item() == pytest.approx(reference.callback_metrics["val/mse"].item())


class StepBatches(pl.Callback):
    def __init__(self):
        self.batches, self.windows = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.windows.append(tuple(self.batches))
        self.batches = []


@pytest.mark.parametrize(
    ("schedule", "windows"),
    [
        ({0: 1, 2: 2}, [(0,), (1,), (2, 3), (0, 1), (2, 3)]),
        ({0: 1, 1: 2}, [(0,), (1,), (2, 3), (0, 1), (2, 3)]),  # batch 1 would start a window out of line
        ({0: 2, 1: 4}, [(0, 1), (2, 3), (0, 1, 2, 3)]),  # batch 2 would too: 4 waits for the next epoch
    ],
)
def test_step_based_accumulation_schedule(schedule, windows):
    recorder = StepBatches()
    module = OOMToy(forward_limit=5)
    trainer = fit(module, [AdaptiveAccumulation(accumulate_schedule=schedule), recorder], max_epochs=2, max_steps=-1)
    assert recorder.windows == windows
    assert trainer.accumulate_grad_batches == schedule[max(schedule)]
    for counts, window in zip(module.counts, recorder.windows, strict=True):
        torch.testing.assert_close(counts.sum(), torch.tensor(16.0 * len(window)))  # every sample of the window once


def test_teardown_puts_the_steps_back():
    module = OOMToy()
    fit(module, [AdaptiveAccumulation()], max_steps=1)
    assert "training_step" not in module.__dict__ and "validation_step" not in module.__dict__


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"shrink": "third"}, r"`shrink` must be 'halve' or a function size -> smaller size, got 'third' \(str\)"),
        ({"loss_reduction": "max"}, "Unknown `loss_reduction`='max'; valid choices: mean, sum"),
        ({"micro_batch_size": 0}, "`micro_batch_size` must be an integer ≥ 1, got 0"),
        ({"micro_batch_size": "abc"}, r"`micro_batch_size` must be an integer ≥ 1, got 'abc' \(str\)"),
        ({"micro_batch_size": True}, r"`micro_batch_size` must be an integer ≥ 1, got True \(bool\)"),
        ({"micro_batch_size": 2.5}, r"`micro_batch_size` must be an integer ≥ 1, got 2.5 \(float\)"),
        ({"grow_after": -10}, "`grow_after` must be an integer ≥ 1, got -10"),
        ({"grow_after": "often"}, r"`grow_after` must be an integer ≥ 1, got 'often' \(str\)"),
        ({"thrash_steps": 0}, "`thrash_steps` must be an integer ≥ 1, got 0"),
        ({"evaluation": "maybe"}, r"`evaluation` must be true or false, got 'maybe' \(str\)"),
        ({"accumulate_schedule": {0: 0}}, r"`accumulate_schedule`\[0\]=0 must be an int ≥ 1"),
    ],
)
def test_bad_arguments(arguments, message):
    with pytest.raises(MisconfigurationException, match="^AdaptiveAccumulation: " + message):
        AdaptiveAccumulation(**arguments)


def test_words_and_whole_floats_are_read_in_their_types():
    callback = AdaptiveAccumulation(micro_batch_size=8.0, thrash_steps=None, evaluation="off")
    assert (callback.sizer.size, callback.evaluation) == (8, False)
    assert isinstance(callback.sizer.size, int) and AdaptiveAccumulation(evaluation="yes").evaluation is True


def test_schedule_and_trainer_accumulation_conflict():
    with pytest.raises(MisconfigurationException, match="both set the accumulation"):
        fit(OOMToy(), [AdaptiveAccumulation(accumulate_schedule={0: 2})], accumulate_grad_batches=4)


def test_manual_optimization_is_refused():
    module = OOMToy()
    module.automatic_optimization = False
    with pytest.raises(MisconfigurationException, match="needs automatic optimization"):
        fit(module, [AdaptiveAccumulation()])


class Opaque:
    """Something no batch splitter knows."""


class OpaqueBatches(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, generator=generator)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return self.x[index], self.y[index], index


def opaque_collate(items):
    x, y, ids = torch.utils.data.default_collate(items)
    return x, y, ids, Opaque()


class OpaqueToy(OOMToy):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:3], batch_idx)

    def train_dataloader(self):
        return DataLoader(OpaqueBatches(), batch_size=16, collate_fn=opaque_collate)


def test_a_batch_it_cannot_split_runs_whole():
    reference, module = OOMToy(), OpaqueToy()
    fit(reference, max_steps=2)
    fit(module, [AdaptiveAccumulation()], max_steps=2)
    assert relative_error(module, reference) < 1e-6


def test_a_batch_it_cannot_split_and_that_runs_out_of_memory():
    with pytest.raises(
        SampleOutOfMemoryError, match=r"cannot be split into micro-batches: .*batch\[3\] of type Opaque"
    ):
        fit(OpaqueToy(forward_limit=4), [AdaptiveAccumulation()], max_steps=1)


class MinimalSignatures(OOMToy):
    """Steps without `batch_idx`, and no validation_step at all: all legal in Lightning."""

    def training_step(self, batch):
        return super().training_step(batch, 0)

    def predict_step(self, batch):
        return super().predict_step(batch, 0)

    validation_step = pl.LightningModule.validation_step


def test_steps_without_batch_idx_and_a_missing_validation_step():
    module, callback = MinimalSignatures(forward_limit=5), AdaptiveAccumulation()
    trainer = fit(module, [callback], max_steps=2, limit_val_batches=None, val_check_interval=1)
    assert not trainer.enable_validation and callback.sizer.size == 4
    predictions = quiet_trainer(callbacks=[AdaptiveAccumulation()]).predict(MinimalSignatures(eval_limit=3))
    assert torch.cat(predictions).shape == (SAMPLES,)


def test_a_dataloader_iter_step_is_refused():
    class IteratorStep(OOMToy):
        def training_step(self, dataloader_iter):
            return super().training_step(next(dataloader_iter)[0], 0)

    with pytest.raises(MisconfigurationException, match=r"`training_step\(dataloader_iter\)`"):
        fit(IteratorStep(), [AdaptiveAccumulation()])


def test_the_hydra_bundle(compose_train):
    cfg = compose_train("memopt=[adaptive,precision]")
    assert list(cfg.memopt.callbacks) == ["adaptive_accumulation", "precision_switch"]
    callback = instantiate(cfg.memopt.callbacks.adaptive_accumulation)
    assert (callback.sizer.grow_after, callback.sizer.thrash_steps, callback.schedule) == (500, 3, None)
    scheduled = compose_train(
        "memopt=adaptive", "memopt.callbacks.adaptive_accumulation.accumulate_schedule={0:1,100:4}"
    )
    assert instantiate(scheduled.memopt.callbacks.adaptive_accumulation).schedule.at(100) == 4


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["forward_limit", "backward_limit"])
def test_ddp_with_an_oom_on_rank_1_only(tmp_path, fault):
    script = Path(__file__).with_name("adaptive_ddp_run.py")
    result = run_script(script, [str(tmp_path), fault], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [4, 4, 4, 4]  # both ranks carry on with rank 1's size
    assert ranks[0]["micro_batches"] == [1, 4, 4, 4]  # rank 0's whole batch fitted at step 0
    assert ranks[1]["micro_batches"] == [4, 4, 4, 4]  # 16 failed, then its first 8: four of 4
    assert ranks[0]["recoveries"] == ranks[1]["recoveries"] == 1
    for got, other in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(got, other)  # one all-reduced gradient per step: the ranks stay identical
    for rank in ranks:
        for got, want in zip(rank["params"], rank["reference"], strict=True):
            assert ((got - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_memopt_micro_batches_give_the_steps_of_whole_batches(tmp_path):
    script = Path(__file__).with_name("adaptive_fsdp_run.py")
    result = run_script(script, [str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        ddp, fsdp = saved["ddp"], saved["fsdp"]
        assert fsdp["micro_batches"] == 4
        torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(ddp["losses"]), rtol=0, atol=1e-5)
        assert len(fsdp["grads"]) == len(ddp["grads"]) == 3  # optimizer steps of two batches each
        for got, want in zip([*fsdp["grads"], fsdp["params"]], [*ddp["grads"], ddp["params"]], strict=True):
            assert all((a - b).abs().max().item() < 1e-5 for a, b in zip(got, want, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("fault", "failing"), [("backward_limit", 1), pytest.param("forward_limit", 0, marks=pytest.mark.slow)]
)
def test_fsdp_memopt_an_oom_on_one_rank_stops_both_at_once(tmp_path, fault, failing):
    script = Path(__file__).with_name("adaptive_fsdp_oom_run.py")
    ranks = run_ranks(script, [fault, str(failing)], cwd=tmp_path, timeout=120)  # TimeoutExpired: a rank hung
    for result in ranks:
        assert result.returncode == 1, result.stdout[-3000:]
        assert "resume from the last checkpoint with AdaptiveAccumulation(micro_batch_size=4)" in result.stdout
    stopped = f"RanksOutOfStepError: AdaptiveAccumulation: out of memory on rank {failing} at step 1 with micro-batches"
    assert stopped in ranks[failing].stdout
    left = f"RanksOutOfStepError: AdaptiveAccumulation: a collective failed on rank {1 - failing} at step 1 with micro"
    assert left in ranks[1 - failing].stdout


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_fsdp_memopt_on_one_device_stops_at_an_oom_and_says_how_to_resume(stage):
    module = OOMToy(forward_limit=4, eval_limit=4)
    trainer = quiet_trainer(strategy=MemoptFSDPStrategy(), max_steps=2, callbacks=[AdaptiveAccumulation(8)],
                            num_sanity_val_steps=0)  # fmt: skip
    with pytest.raises(RanksOutOfStepError) as info:
        trainer.fit(module) if stage == "fit" else trainer.validate(module)
    if stage == "fit":  # not retried: FSDP wrote part of the gradients into the shards, outside the runner's hooks
        assert "out of memory on rank 0 at step 0 with micro-batches of 8 (of 16) under fsdp_memopt" in str(info.value)
        assert (info.value.micro_batch_size, info.value.resume_size) == (8, 4)
    else:  # run whole, as on every rank under fsdp_memopt
        assert "in validation_step with whole batches of 16" in str(info.value)
        assert "give the validation dataloader smaller batches" in str(info.value)


def test_fsdp_memopt_refuses_to_grow_the_micro_batches():
    with pytest.raises(MisconfigurationException, match="`grow_after`=10 under fsdp_memopt"):
        fit(OOMToy(), [AdaptiveAccumulation(grow_after=10)], strategy=MemoptFSDPStrategy())


@pytest.mark.cuda
def test_a_real_cuda_oom_is_recovered():
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory

    class Wide(OOMToy):
        def training_step(self, batch, batch_idx):
            x, y, ids = batch
            wide = x.repeat(1, 2**21)  # 64 MiB per sample, kept for the backward by pow
            return (self(x) - y).pow(2).mean() + wide.pow(2).mean() * 0 + self.counter(ids).mean()

    reference = OOMToy(batch_size=SAMPLES, optimizer="sgd")
    fit(reference, max_steps=2, accelerator="cuda")
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)  # a 2 GiB device: 4 GiB per batch fails
    try:
        module, callback = Wide(batch_size=SAMPLES, optimizer="sgd"), AdaptiveAccumulation()
        fit(module, [callback], max_steps=2, accelerator="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert callback.sizer.oom_recoveries == 1 and callback.sizer.size < SAMPLES
    assert relative_error(module.cpu(), reference.cpu()) < 1e-5


class Broken(OOMToy):
    def training_step(self, batch, batch_idx):
        raise ValueError("a bug in the user's step")


def test_an_error_in_training_puts_the_steps_back_too():
    module = Broken()
    with pytest.raises(ValueError, match="a bug in the user's step"):
        fit(module, [AdaptiveAccumulation()], max_steps=1)
    assert "training_step" not in module.__dict__ and "validation_step" not in module.__dict__


# ---------------------------------------------------------------- the smallest micro-batch the model takes
def _face_module():
    from lightning_memopt.tasks import FaceRecognitionModule

    return FaceRecognitionModule(
        num_classes=4, backbone="iresnet_tiny", lr=0.05, scale=16.0, margin_list=(1.0, 0.2, 0.0)
    )  # its IResNet ends in BatchNorm1d: one sample in training is a ValueError


def _faces(batch_size=8):
    from tests.tasks.test_face_recognition import _clustered_faces

    return DataLoader(_clustered_faces(per_class=4), batch_size=batch_size)


def test_a_face_model_with_micro_batches_of_one_trains_in_pieces_of_two(recwarn):
    callback = AdaptiveAccumulation(micro_batch_size=1)
    module = _face_module()
    pieces = []
    module.on_train_batch_end = lambda *args: pieces.append(
        (callback.last_micro_batch_size, callback.last_micro_batches)
    )
    trainer = quiet_trainer(max_steps=2, callbacks=[callback], limit_val_batches=0)
    trainer.fit(module, _faces(batch_size=4))
    assert pieces == [(2, 2), (2, 2)]  # batches of 4 in two micro-batches of 2
    raised = [str(w.message) for w in recwarn if "are raised to" in str(w.message)]
    assert raised == [
        "AdaptiveAccumulation: micro-batches of 1 are raised to 2, the smallest the model takes: its BatchNorm1d, "
        "BatchNorm2d layers need at least 2 samples in training"
    ]
    assert callback.sizer.size == 2 and callback.learned_min_size is None


def test_a_face_model_whose_two_samples_do_not_fit_reports_their_profile():
    module, data = _face_module(), _faces()
    trainer = quiet_trainer(max_steps=1, callbacks=[AdaptiveAccumulation()], limit_val_batches=0)
    # a batch of 8 images fits (about 0.2 MiB), a training step on 2 samples (about 1.2 MiB) does not
    with pytest.raises(SampleOutOfMemoryError) as info, SimulatedDevice(640 * 2**10):
        trainer.fit(module, data)
    message = str(info.value)
    assert (
        "a micro-batch of 2 samples, the smallest the model takes (its BatchNorm1d, BatchNorm2d layers need at "
        "least 2 samples in training), does not fit" in message
    )
    assert "A training step on those 2 samples, predicted in fake mode" in message
    assert info.value.profile is not None and info.value.profile.peak_bytes > 0
    assert info.value.size == 2 and info.value.sample[0].shape == (2, 3, 32, 32)


class RejectsOneSample(OOMToy):
    """No batch norm, but a training step that refuses a batch of one sample."""

    def training_step(self, batch, batch_idx):
        if len(batch[0]) == 1:
            raise ValueError("Expected more than 1 value per channel when training")
        return super().training_step(batch, batch_idx)


def test_a_learned_minimum_is_kept_in_the_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    first = AdaptiveAccumulation(micro_batch_size=8)
    saver = OnExceptionCheckpoint(dirpath=tmp_path, filename="failed")
    with pytest.raises(MicroBatchSizeError, match="a micro-batch of 1 sample raised ValueError: Expected more") as info:
        fit(RejectsOneSample(batch_size=17), [first, saver], max_steps=2, enable_checkpointing=True)  # 8 + 8 + 1
    assert isinstance(info.value.__cause__, ValueError)
    assert first.learned_min_size == 2
    state = first.state_dict()
    assert state["learned_min_size"] == 2 and "a micro-batch of 1 sample raised" in state["learned_min_size_reason"]

    # restored after setup, from the checkpoint written when it failed
    resumed, sizes = AdaptiveAccumulation(micro_batch_size=8), []
    module = RejectsOneSample(batch_size=17)
    module.on_train_batch_end = lambda *args: sizes.append(resumed.last_micro_batches)
    fit(module, [resumed], max_steps=2, ckpt_path=str(tmp_path / "failed.ckpt"))
    assert resumed.learned_min_size == 2 and sizes == [3, 3]  # 8, 7, 2
    assert resumed.recovery.runner.min_size == 2

    # restored before setup, and from an older checkpoint without the keys
    loaded = AdaptiveAccumulation(micro_batch_size=8)
    loaded.load_state_dict(state)
    fit(RejectsOneSample(batch_size=17), [loaded], max_steps=2)
    old = AdaptiveAccumulation()
    old.load_state_dict({key: value for key, value in state.items() if not key.startswith("learned_min_size")})
    assert old.learned_min_size is None and old.state_dict()["learned_min_size"] is None


def test_evaluation_with_batch_norm_in_eval_mode_still_goes_down_to_one_sample():
    callback = AdaptiveAccumulation()
    predictions = quiet_trainer(callbacks=[callback]).predict(OOMToy(batchnorm=True, eval_limit=1))
    assert torch.cat(predictions).shape == (SAMPLES,) and callback.eval_micro_batch_size == 1
