import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_memopt.callbacks.precision_switch as precision_switch_module
import lightning_memopt.precision.plugin as plugin_module
from lightning_memopt.callbacks import PrecisionSwitch
from lightning_memopt.precision import SwitchablePrecision
from lightning_memopt.strategies import MemoptFSDPStrategy
from tests.helpers import quiet_trainer, run_script


class Toy(pl.LightningModule):
    """A small regression model whose steps can be made to fail.

    ``faults`` maps a global step to ``"overflow"`` (activations beyond fp16's range), ``"nan_loss"``
    (a NaN added to the loss: gradients stay finite), ``"nan_input"`` (NaN through the whole step,
    batch norm included) or ``"nan_grad"`` (a NaN written into one gradient), or is a callable of
    (step, rank).
    """

    def __init__(self, faults=None, batchnorm=False, scale_loss=1.0, samples=64):
        super().__init__()
        self.samples = samples
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 1))
        self.faults = faults or {}
        self.scale_loss = scale_loss
        self.seen = []  # (global step, batch index, autocast dtype or None)

    def fault(self):
        if callable(self.faults):
            return self.faults(self.trainer.global_step, self.global_rank)
        return self.faults.get(self.trainer.global_step)

    def training_step(self, batch, batch_idx):
        x, y = batch
        on = torch.is_autocast_enabled("cpu")
        self.seen.append((self.trainer.global_step, batch_idx, torch.get_autocast_dtype("cpu") if on else None))
        fault = self.fault()
        if fault == "overflow":
            x = x * 1e6
        if fault == "nan_input":
            x = x * float("nan")
        loss = ((self.net(x) - y) ** 2).mean() * self.scale_loss
        return loss + float("nan") if fault == "nan_loss" else loss

    def on_after_backward(self):
        if self.fault() == "nan_grad":
            self.net[0].weight.grad[0, 0] = float("nan")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(self.samples, 8, generator=generator), torch.randn(self.samples, 1, generator=generator)
        )
        return DataLoader(data, batch_size=8)

    def dtypes(self):
        return [dtype for _, _, dtype in self.seen]


class StateRecorder(pl.Callback):
    """Parameters and optimizer state after every training batch."""

    def __init__(self):
        self.params, self.optimizer_state = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append([p.detach().clone() for p in pl_module.parameters()])
        self.optimizer_state.append(copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))


def fit(module, switch, max_steps=6, ckpt_path=None, callbacks=(), **trainer_options):
    trainer = quiet_trainer(max_steps=max_steps, callbacks=[switch, *callbacks], **trainer_options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _finite(module, trainer):
    params = all(torch.isfinite(p).all() for p in module.parameters())
    state = trainer.optimizers[0].state_dict()["state"].values()
    return params and all(torch.isfinite(v).all() for entry in state for v in entry.values())


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_auto_on_the_cpu_trains_in_bf16_and_says_why(monkeypatch):
    messages = []
    monkeypatch.setattr(precision_switch_module, "rank_zero_info", messages.append)
    module, switch = Toy(), PrecisionSwitch()
    trainer = fit(module, switch, max_steps=3)
    assert trainer.precision == "bf16-mixed"
    assert isinstance(trainer.strategy.precision_plugin, SwitchablePrecision)
    assert module.dtypes() == [torch.bfloat16] * 3
    assert messages[0] == "PrecisionSwitch: bf16-mixed on cpu (the CPU runs bf16 autocast); fail-safe on (patience 3)"
    assert trainer.callback_metrics["memopt/precision"] == 7.0
    assert trainer.callback_metrics["memopt/skipped_steps"] == 0.0


def test_a_step_schedule_switches_at_its_boundary():
    module = Toy()
    trainer = fit(module, PrecisionSwitch("bf16-mixed", schedule={0: "32-true", 3: "bf16-mixed"}), max_steps=5)
    assert module.dtypes() == [None, None, None, torch.bfloat16, torch.bfloat16]
    assert [entry["step"] for entry in trainer.strategy.precision_plugin.history] == [3]


def test_with_accumulation_every_optimizer_step_runs_in_one_precision():
    module = Toy()
    fit(module, PrecisionSwitch("32-true", schedule=[[1, "bf16"], [2, 32]]), max_steps=3, accumulate_grad_batches=2)
    assert [(step, dtype) for step, _, dtype in module.seen] == [
        (0, None), (0, None), (1, torch.bfloat16), (1, torch.bfloat16), (2, None), (2, None),
    ]  # fmt: skip


def test_an_epoch_schedule():
    module = Toy()
    fit(module, PrecisionSwitch("32-true", schedule={1: "bf16-mixed"}, schedule_interval="epoch"), max_steps=16)
    assert module.dtypes() == [None] * 8 + [torch.bfloat16] * 8


def test_a_nan_gradient_skips_the_step_without_touching_weights_or_optimizer_state():
    module, recorder = Toy(faults={2: "nan_grad"}), StateRecorder()
    trainer = fit(module, PrecisionSwitch("32-true", fail_safe=True), max_steps=5, callbacks=[recorder])
    assert _equal(recorder.params[1], recorder.params[2])  # step 2 skipped
    assert not _equal(recorder.params[2], recorder.params[3])  # step 3 trained
    assert torch.equal(recorder.optimizer_state[1][0]["exp_avg"], recorder.optimizer_state[2][0]["exp_avg"])
    assert recorder.optimizer_state[2][0]["step"] == recorder.optimizer_state[1][0]["step"] == 2
    plugin = trainer.strategy.precision_plugin
    assert (plugin.skipped_steps, plugin.history, plugin.precision) == (1, [], "32-true")
    assert trainer.global_step == 5 and _finite(module, trainer)


def test_a_loss_that_overflows_in_fp16_steps_down_to_bf16(monkeypatch):
    messages = []
    monkeypatch.setattr(plugin_module, "rank_zero_info", messages.append)
    module, recorder = Toy(faults=lambda step, rank: "overflow"), StateRecorder()
    initial = [p.detach().clone() for p in module.parameters()]
    trainer = fit(module, PrecisionSwitch("16-mixed", fail_safe=True, patience=2), max_steps=5, callbacks=[recorder])
    assert module.dtypes() == [torch.float16] * 2 + [torch.bfloat16] * 3
    assert _equal(initial, recorder.params[1])  # both fp16 steps skipped
    assert not _equal(recorder.params[1], recorder.params[2])  # bf16 holds 1e6 activations: it trains
    assert messages == ["PrecisionSwitch: step 1: 16-mixed → bf16-mixed (non-finite loss in 2 consecutive steps)"]
    plugin = trainer.strategy.precision_plugin
    assert (plugin.precision, plugin.floor, plugin.scaler, plugin.skipped_steps) == (
        "bf16-mixed",
        "bf16-mixed",
        None,
        2,
    )
    assert _finite(module, trainer)


def test_nan_gradients_in_bf16_step_down_to_32_true_and_a_schedule_cannot_go_back():
    module = Toy(faults={0: "nan_grad", 1: "nan_grad"})
    switch = PrecisionSwitch("bf16-mixed", schedule={3: "bf16-mixed"}, fail_safe=True, patience=2)
    trainer = fit(module, switch, max_steps=5)
    assert module.dtypes() == [torch.bfloat16] * 2 + [None] * 3
    assert trainer.strategy.precision_plugin.history[0]["reason"] == "non-finite gradient norm in 2 consecutive steps"
    assert trainer.callback_metrics["memopt/precision"] == 23.0
    assert trainer.callback_metrics["memopt/skipped_steps"] == 2.0
    assert _finite(module, trainer)


def test_a_collapsing_fp16_loss_scale_steps_down():
    # gradients of 1e3 × scale overflow fp16 in the backward at every scale the scaler tries
    module = Toy(scale_loss=1e3)
    trainer = fit(module, PrecisionSwitch("16-mixed", fail_safe=True, min_loss_scale=2.0**12), max_steps=8)
    plugin = trainer.strategy.precision_plugin
    reasons = [entry["reason"] for entry in plugin.history]
    assert reasons == ["fp16 loss scale 2048 fell below 4096"], reasons
    assert plugin.history[0]["step"] == 4 and plugin.skipped_steps == 5
    assert module.dtypes()[5:] == [torch.bfloat16] * 3 and _finite(module, trainer)


def test_non_finite_steps_in_32_true_raise():
    with pytest.raises(FloatingPointError, match=r"non-finite loss in 3 consecutive steps in 32-true, the safest"):
        fit(Toy(faults=lambda step, rank: "nan_loss"), PrecisionSwitch("32-true", fail_safe=True), max_steps=5)


def test_batch_norm_statistics_are_put_back_after_a_skipped_step():
    module, recorder = Toy(faults={1: "nan_input"}, batchnorm=True), StateRecorder()
    means = []

    class Means(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            means.append(pl_module.net[1].running_mean.clone())

    fit(module, PrecisionSwitch("32-true", fail_safe=True), max_steps=3, callbacks=[recorder, Means()])
    assert torch.equal(means[0], means[1]) and torch.isfinite(means[2]).all()
    assert not torch.equal(means[1], means[2])


def test_resume_mid_schedule_continues_exactly(tmp_path):
    def switch():
        return PrecisionSwitch("32-true", schedule={0: "32-true", 4: "bf16-mixed"})

    # two batches an epoch, a checkpoint after step 2: where Lightning resumes a plain DataLoader exactly
    straight = Toy(samples=16)
    fit(straight, switch(), max_steps=6)
    saver = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit(Toy(samples=16), switch(), max_steps=4, callbacks=[saver], enable_checkpointing=True)
    resumed, resumed_switch = Toy(samples=16), switch()
    fit(resumed, resumed_switch, max_steps=6, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert resumed.dtypes() == straight.dtypes()[2:] == [None, None, torch.bfloat16, torch.bfloat16]
    assert _equal(list(straight.parameters()), list(resumed.parameters()))
    assert resumed_switch.state_dict()["position"] == 5


def test_resume_keeps_the_fail_safe_floor_and_the_loss_scale(tmp_path):
    stepped_down = fit(Toy(faults={0: "overflow", 1: "overflow"}), PrecisionSwitch(16, fail_safe=True, patience=2), 3)
    stepped_down.save_checkpoint(tmp_path / "floor.ckpt")
    module = Toy()
    trainer = fit(
        module, PrecisionSwitch(16, fail_safe=True, patience=2), max_steps=5, ckpt_path=tmp_path / "floor.ckpt"
    )
    assert module.dtypes() == [torch.bfloat16] * 2
    assert trainer.strategy.precision_plugin.floor == "bf16-mixed"
    assert [entry["to"] for entry in trainer.strategy.precision_plugin.history] == ["bf16-mixed"]

    overflowed_once = fit(Toy(faults={1: "overflow"}), PrecisionSwitch("16-mixed"), max_steps=3)
    scale = overflowed_once.strategy.precision_plugin.scaler.get_scale()
    assert scale == 2.0**15
    overflowed_once.save_checkpoint(tmp_path / "scale.ckpt")
    scales = []

    class Scale(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            scales.append(trainer.strategy.precision_plugin.scaler.get_scale())

    fit(Toy(), PrecisionSwitch("16-mixed"), max_steps=4, ckpt_path=tmp_path / "scale.ckpt", callbacks=[Scale()])
    assert scales == [scale]


def test_resuming_under_another_schedule_warns(tmp_path):
    trainer = fit(Toy(), PrecisionSwitch("32-true", schedule={0: "32-true"}), max_steps=1)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.warns(UserWarning, match=r"resuming with schedule 'step 0: bf16-mixed'.*'step 0: 32-true'"):
        fit(Toy(), PrecisionSwitch("32-true", schedule={0: "bf16"}), max_steps=2, ckpt_path=tmp_path / "a.ckpt")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, r"Unknown `precision`='fp8'; valid choices: 32-true, bf16-mixed, 16-mixed"),
        ({"schedule": {500: "bf16-mixed", 0: "32-true"}}, r"`schedule` is not sorted"),
        ({"schedule": [[0, "32-true"], [0, "bf16-mixed"]]}, r"`schedule` entries overlap"),
        ({"schedule_interval": "batch"}, r"Unknown `schedule_interval`='batch'; valid choices: step, epoch"),
        ({"patience": 0}, r"`patience` must be an integer ≥ 1, got 0"),
        ({"patience": -2}, r"`patience` must be an integer ≥ 1, got -2"),
        ({"patience": "3"}, r"`patience` must be an integer ≥ 1, got '3' \(str\)"),
        ({"patience": True}, r"`patience` must be an integer ≥ 1, got True \(bool\)"),
        ({"min_loss_scale": 0}, r"`min_loss_scale` must be a number > 0, got 0"),
        ({"min_loss_scale": "abc"}, r"`min_loss_scale` must be a number > 0, got 'abc' \(str\)"),
        ({"fail_safe": "maybe"}, r"`fail_safe` must be true, false or null, got 'maybe' \(str\)"),
        ({"fail_safe": 2}, r"`fail_safe` must be true, false or null, got 2 \(int\)"),
        ({"schedule": 5}, r"`schedule` must be \{start: precision\} or a list .*, got 5 \(int\)"),
        ({"fp32_modules": []}, r"`fp32_modules` is empty"),
        ({"fp32_modules": True}, r"`fp32_modules` must be module classes, dotted class paths or name globs, got True"),
    ],
)
def test_bad_arguments_are_refused_with_the_choices(kwargs, message):
    with pytest.raises(MisconfigurationException, match="^PrecisionSwitch: " + message):
        PrecisionSwitch(**kwargs)


@pytest.mark.parametrize(
    ("precision", "fail_safe", "expected"),
    [
        ("auto", "off", False),  # Hydra's `fail_safe=off` is the string "off": off, not bool("off")
        ("auto", "no", False),
        ("auto", "False", False),
        ("auto", "0", False),
        ("auto", 0, False),
        ("32-true", "on", True),
        ("32-true", "yes", True),
        ("32-true", "TRUE", True),
        ("32-true", "1", True),
        ("auto", "null", True),  # unset: on for auto
        ("32-true", None, False),  # unset: off for an explicit precision
    ],
)
def test_fail_safe_words_are_read_strictly(precision, fail_safe, expected):
    assert PrecisionSwitch(precision, fail_safe=fail_safe).fail_safe is expected


def test_the_plugin_checks_its_own_arguments():
    assert SwitchablePrecision(fail_safe="off").fail_safe is False
    with pytest.raises(ValueError, match=r"`fail_safe` must be true or false, got 'maybe' \(str\)"):
        SwitchablePrecision(fail_safe="maybe")
    with pytest.raises(TypeError, match=r"`patience` must be an integer ≥ 1, got '3' \(str\)"):
        SwitchablePrecision(patience="3")


def test_a_trainer_with_its_own_precision_is_refused():
    trainer = quiet_trainer(max_steps=1, precision="bf16-mixed", callbacks=[PrecisionSwitch()])
    with pytest.raises(MisconfigurationException, match=r"already has `precision`='bf16-mixed'.*leave Trainer"):
        trainer.fit(Toy())


def test_fp32_islands_that_match_nothing_are_refused_at_setup():
    with pytest.raises(MisconfigurationException, match=r"`fp32_modules` entry 'margin' matches no module"):
        fit(Toy(), PrecisionSwitch("bf16-mixed", fp32_modules=["margin"]), max_steps=1)


def test_fp32_islands_run_in_fp32_and_are_removed_after_fit():
    module = Toy()
    outputs = []
    module.net[3].register_forward_hook(lambda m, args, out: outputs.append(out.dtype))
    switch = PrecisionSwitch("bf16-mixed", fp32_modules=["net.3"])
    fit(module, switch, max_steps=2)
    assert switch.islands == ["net.3"] and outputs == [torch.float32] * 2
    assert "forward" not in module.net[3].__dict__


def test_the_hydra_configs_compose_into_one_callback(compose_train):
    cfg = compose_train("precision=auto", "memopt=precision")
    assert list(cfg.memopt.callbacks) == ["precision_switch"]
    switch = instantiate(cfg.memopt.callbacks.precision_switch)
    assert (switch.precision, switch.fail_safe, switch.fp32_modules) == ("auto", True, "preset")
    assert cfg.trainer.precision == "32-true"


@pytest.mark.parametrize(("word", "expected"), [("off", False), ("no", False), ("on", True), ("true", True)])
def test_fail_safe_from_the_command_line_is_a_word_not_a_truth_value(compose_train, word, expected):
    cfg = compose_train("memopt=precision", f"memopt.callbacks.precision_switch.fail_safe={word}")
    assert instantiate(cfg.memopt.callbacks.precision_switch).fail_safe is expected
    refused = compose_train("memopt=precision", "memopt.callbacks.precision_switch.patience=abc")
    with pytest.raises(Exception, match=r"PrecisionSwitch: `patience` must be an integer ≥ 1, got 'abc' \(str\)"):
        instantiate(refused.memopt.callbacks.precision_switch)


@pytest.mark.slow
def test_ddp_ranks_skip_and_switch_together(tmp_path):
    script = Path(__file__).with_name("precision_ddp_run.py")
    result = run_script(script, [str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for key in ("history", "skipped_steps", "precision", "dtypes"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["precision"] == "32-true" and ranks[0]["skipped_steps"] == 2
    assert _equal(ranks[0]["params"], ranks[1]["params"])
    assert all(torch.isfinite(p).all() for p in ranks[0]["params"])


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_memopt_switches_and_skips_steps_like_ddp(tmp_path):
    script = Path(__file__).with_name("precision_fsdp_run.py")
    result = run_script(script, [str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for rank in ranks:
        ddp, fsdp = rank["ddp"], rank["fsdp"]
        assert [(entry["step"], entry["to"]) for entry in fsdp["history"]] == [(2, "bf16-mixed")]
        assert fsdp["dtypes"] == ddp["dtypes"] == [None, None] + [torch.bfloat16] * 4
        losses = [torch.tensor(run["losses"]) for run in (fsdp, ddp)]
        torch.testing.assert_close(*losses, rtol=0, atol=1e-5, equal_nan=True)  # per step, scheduled switch included
        # step 3: a NaN loss on rank 1 only; step 4: a NaN in rank 0's own gradient shard only. Both ranks skip both.
        assert fsdp["skipped_steps"] == ddp["skipped_steps"] == 2
        params = fsdp["params"]
        assert _equal(params[2], params[3]) and _equal(params[3], params[4]) and not _equal(params[4], params[5])
        assert all((a - b).abs().max() < 1e-5 for a, b in zip(params[-1], ddp["params"][-1], strict=True))
        # 16-mixed: an inf in rank 0's shard at step 3 backs the loss scale off, and skips the step, on both ranks
        scales, params = rank["fsdp16"]["scales"], rank["fsdp16"]["params"]
        assert scales == ranks[0]["fsdp16"]["scales"] and scales[3] == scales[2] / 2
        assert _equal(params[2], params[3]) and not _equal(params[3], params[4])
    assert _equal(ranks[0]["fsdp"]["params"][-1], ranks[1]["fsdp"]["params"][-1])


def test_fsdp_memopt_with_a_param_dtype_of_its_own_is_refused():
    with pytest.raises(MisconfigurationException, match=r"MemoptFSDPStrategy\(param_dtype='bf16'\) would gather"):
        fit(Toy(), PrecisionSwitch("bf16-mixed"), max_steps=1, strategy=MemoptFSDPStrategy(param_dtype="bf16"))


@pytest.mark.cuda
def test_auto_on_a_cuda_device_follows_its_capability():
    module = Toy()
    trainer = quiet_trainer(accelerator="cuda", max_steps=2, callbacks=[PrecisionSwitch()])
    trainer.fit(module)
    expected = "bf16-mixed" if torch.cuda.get_device_capability() >= (8, 0) else "16-mixed"
    assert trainer.precision == expected


@pytest.mark.cuda
def test_an_fp16_overflow_on_cuda_steps_down():
    module = Toy(faults={0: "overflow", 1: "overflow"})
    trainer = quiet_trainer(
        accelerator="cuda", max_steps=4, callbacks=[PrecisionSwitch(16, fail_safe=True, patience=2)]
    )
    trainer.fit(module)
    plugin = trainer.strategy.precision_plugin
    assert [entry["to"] for entry in plugin.history] == [
        "bf16-mixed" if torch.cuda.get_device_capability() >= (8, 0) else "32-true"
    ]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_islands_and_checkpointing_both_reach_layers_built_in_configure_model():
    from lightning_memopt import ActivationCheckpointing
    from lightning_memopt.checkpointing import checkpoint_mode
    from lightning_memopt.precision import is_fp32_island

    class Late(Toy):
        def __init__(self):
            super().__init__()
            del self.net

        def configure_model(self):
            if not hasattr(self, "net"):
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(8, 16), nn.Identity(), nn.ReLU(), nn.Linear(16, 1))

    module, seen = Late(), []

    class Check(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append((checkpoint_mode(pl_module.net[0]), is_fp32_island(pl_module.net[3])))

    callbacks = [ActivationCheckpointing({"modules": "net.0"}), Check()]
    fit(module, PrecisionSwitch("bf16-mixed", fp32_modules=["net.3"]), max_steps=1, callbacks=callbacks)
    assert seen == [("full", True)]
