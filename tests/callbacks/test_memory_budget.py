import json
import re
import shlex
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memopt import ActivationCheckpointing, AdaptiveAccumulation, MemoryBudget, PrecisionSwitch
from lightning_memopt.callbacks import memory_budget
from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.train import planned_knobs
from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.planner import Knobs
from lightning_memopt.planner.calibration import CACHE_VARIABLE
from lightning_memopt.planner.knobs import train_command
from lightning_memopt.tasks import NormalEstimationModule
from tests.helpers import quiet_trainer, run_script

APPLIED = (AdaptiveAccumulation, PrecisionSwitch, ActivationCheckpointing)
_SEEDED = torch.Generator().manual_seed(0)  # the same batch in every process (the DDP runs import it)
BATCH = (
    torch.randn(4, 3, 64, 48, generator=_SEEDED),
    torch.nn.functional.normalize(torch.randn(4, 3, 64, 48, generator=_SEEDED), dim=1),
)


def _module():
    return NormalEstimationModule(backbone="sapiens_tiny", warmup_steps=0)


def _loader():
    images, normals = BATCH
    data = [
        {"image": images[i], "normal": normals[i], "mask": torch.ones(1, 64, 48, dtype=torch.bool)} for i in range(4)
    ]
    return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(budget_callback, tmp_path, **trainer_options):
    trainer = quiet_trainer(max_steps=2, callbacks=[budget_callback], default_root_dir=tmp_path, **trainer_options)
    trainer.fit(_module(), train_dataloaders=_loader())
    return trainer


def test_a_tight_budget_plans_and_applies_a_saving(tmp_path):
    budget = MemoryBudget(budget=9.0 / 1024)  # GiB: less than the step needs as it is
    trainer = _fit(budget, tmp_path)
    assert budget.plan is not None and budget.plan.chosen is not None
    knobs = budget.knobs
    assert knobs == budget.plan.chosen.knobs
    assert knobs.checkpoint != "none" or knobs.micro_batch_size is not None or knobs.precision != "32-true"
    (accumulation,) = [c for c in budget.applied if isinstance(c, AdaptiveAccumulation)]
    assert accumulation.last_micro_batch_size == knobs.micro_batch_size or knobs.micro_batch_size is None
    assert any(isinstance(c, ActivationCheckpointing) for c in budget.applied) == (knobs.checkpoint != "none")
    assert trainer.global_step == 2


def test_given_knobs_are_applied_without_planning_and_survive_resume(tmp_path):
    knobs = {"precision": "bf16-mixed", "checkpoint": "full", "every_n": 2, "micro_batch_size": 2}
    budget = MemoryBudget(knobs=knobs)
    trainer = _fit(budget, tmp_path)
    assert budget.plan is None
    assert {type(c) for c in budget.applied} == {AdaptiveAccumulation, PrecisionSwitch, ActivationCheckpointing}
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"][budget.state_key]["knobs"] == Knobs(**knobs).as_dict()
    resumed = MemoryBudget(knobs=knobs)
    trainer = quiet_trainer(max_steps=3, callbacks=[resumed], default_root_dir=tmp_path)
    trainer.fit(_module(), train_dataloaders=_loader(), ckpt_path=path)
    assert trainer.global_step == 3 and resumed.knobs == Knobs(**knobs)
    replanned = quiet_trainer(max_steps=3, callbacks=[MemoryBudget(budget=1.0)], default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match="the checkpoint was trained with 'bf16-mixed, full every 2"):
        replanned.fit(_module(), train_dataloaders=_loader(), ckpt_path=path)


def test_callbacks_that_would_apply_the_plan_twice_are_refused(tmp_path):
    trainer = quiet_trainer(max_steps=1, callbacks=[MemoryBudget(budget=1.0), PrecisionSwitch("32-true")])
    with pytest.raises(MisconfigurationException, match="remove the Trainer's own PrecisionSwitch"):
        trainer.fit(_module(), train_dataloaders=_loader())


def test_a_trainers_own_adaptive_accumulation_beside_memory_budget_is_refused(tmp_path):
    budget = MemoryBudget(knobs={"micro_batch_size": 2})
    trainer = quiet_trainer(max_steps=1, callbacks=[budget, AdaptiveAccumulation()], default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match="remove the Trainer's own AdaptiveAccumulation"):
        trainer.fit(_module(), train_dataloaders=_loader())


def test_nothing_fitting_is_an_error_with_the_table(tmp_path):
    with pytest.raises(MisconfigurationException, match="model states alone|no configuration that keeps the result"):
        _fit(MemoryBudget(budget=1.0 / 1024), tmp_path)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"gpu": "a6000"}, "Unknown `gpu`='a6000'; valid names: v100_16gb"),
        ({"gpu": 3090}, "Unknown `gpu`=3090; valid names: v100_16gb"),
        ({"budget": -1}, "`budget` must be a number > 0, got -1"),
        ({"budget": "abc"}, "`budget` must be a number > 0, got 'abc' (str)"),
        ({"budget": True}, "`budget` must be a number > 0, got True (bool)"),
        ({"safety_margin": 1.0}, "`safety_margin` must be a number ≥ 0 and < 1, got 1.0"),
        ({"safety_margin": "tenth"}, "`safety_margin` must be a number ≥ 0 and < 1, got 'tenth' (str)"),
        ({"verify": -1}, "`verify` must be an integer ≥ 0, got -1"),
        ({"knobs": {"precision": "fp8"}}, "Unknown `precision`='fp8'"),
        ({"knobs": {"layers": 2}}, "Unknown `knobs` fields ['layers']; valid fields: precision, attn_impl"),
        ({"knobs": "bf16-mixed"}, "`knobs` must be a mapping of precision, attn_impl, checkpoint"),
        ({"knobs": {"every_n": "2x"}}, "`every_n` must be an integer ≥ 1, got '2x' (str)"),
        ({"knobs": {"cpu_offload": "maybe"}}, "`cpu_offload` must be true or false, got 'maybe' (str)"),
        ({"blocks": 12}, "`blocks`=12 must be 'auto'"),
        ({"blocks": ["layers.*", 3]}, "`blocks` entry 3 must be a module class, a dotted class path or a name glob"),
        ({"measure": "again"}, "`measure`='again' is not one of the valid choices: 'auto', 'refresh', True, False"),
        ({"measure_candidates": 0}, "`measure_candidates` must be an integer ≥ 1, got 0"),
        ({"measure_steps": 0}, "`measure_steps` must be an integer ≥ 1, got 0"),
        ({"measure_seconds": 0}, "`measure_seconds`"),
    ],
)
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(MisconfigurationException, match="^MemoryBudget: " + re.escape(message)):
        MemoryBudget(**arguments)


def test_knobs_from_a_config_are_read_in_their_types():
    knobs = MemoryBudget(knobs={"precision": "32-true", "every_n": 2.0, "cpu_offload": "off"}).knobs
    assert knobs == Knobs("32-true", every_n=2, cpu_offload=False) and knobs.cpu_offload is False


def test_the_printed_command_composes_to_the_same_knobs():
    knobs = Knobs("bf16-mixed", "sdpa", "full", every_n=2, micro_batch_size=8)
    command = train_command(["model=sapiens_2b", "gpu=a800_80gb", "plan.png=x.png"], knobs)
    overrides = shlex.split(command)[1:]  # as the shell passes them
    assert overrides == [
        "model=sapiens_2b",
        "knobs={precision:bf16-mixed,attn_impl:sdpa,checkpoint:full,every_n:2,micro_batch_size:8}",
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    (callback,) = planned_knobs(cfg.knobs, [])
    assert isinstance(callback, MemoryBudget) and callback.knobs == knobs
    with pytest.raises(ValueError, match="`knobs` apply a plan, and the `memopt` bundle has a MemoryBudget"):
        planned_knobs(cfg.knobs, [callback])


def test_a_sharded_or_offloaded_plan_prints_the_fsdp_memopt_command_with_the_same_knobs():
    knobs = Knobs("bf16-mixed", checkpoint="full", shards=4, cpu_offload=True)
    command = train_command(["model=sapiens_2b", "strategy=ddp", "trainer.devices=8"], knobs)
    overrides = shlex.split(command)[1:]
    assert overrides[:5] == [
        "model=sapiens_2b",
        "strategy=fsdp_memopt",
        "trainer.devices=4",
        "trainer.strategy.cpu_offload=true",
        "precision=bf16_mixed",  # the Trainer's own: fsdp_memopt gathers the units in it, as planned
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    assert cfg.trainer.strategy.cpu_offload is True and cfg.trainer.devices == 4
    (callback,) = planned_knobs(cfg.knobs, [])
    assert isinstance(callback, MemoryBudget) and callback.knobs == knobs


@pytest.mark.slow
def test_only_an_offloaded_plan_fitting_stops_a_single_device_run_with_the_fsdp_command(tmp_path):
    # the model states (3.5 MiB) do not fit unsharded; the margin of the budget this test was sized for
    budget = MemoryBudget(budget=2.5 / 1024, gpu="a100_80gb", safety_margin=0.1)
    with pytest.raises(MisconfigurationException) as error:
        _fit(budget, tmp_path)
    message = str(error.value)
    assert "smaller than the model states alone" in message and "only a plan with fsdp_memopt fits" in message
    assert "strategy=fsdp_memopt trainer.devices=1 trainer.strategy.cpu_offload=true" in message


def test_given_knobs_that_shard_or_offload_need_fsdp_memopt(tmp_path):
    with pytest.raises(MisconfigurationException, match="need the fsdp_memopt strategy, not SingleDeviceStrategy: .*"
                       "strategy=fsdp_memopt trainer.devices=1 trainer.strategy.cpu_offload=true"):  # fmt: skip
        _fit(MemoryBudget(knobs={"cpu_offload": True}), tmp_path)


def test_a_trainer_running_the_plans_precision_itself_gets_no_precision_switch(tmp_path):
    budget = MemoryBudget(knobs={"precision": "bf16-mixed", "checkpoint": "full"})
    trainer = _fit(budget, tmp_path, precision="bf16-mixed")  # as memopt-plan's fsdp_memopt commands run
    assert {type(c) for c in budget.applied} == {AdaptiveAccumulation, ActivationCheckpointing}
    assert trainer.global_step == 2
    with pytest.raises(
        MisconfigurationException, match="`knobs` precision='32-true' but the Trainer runs 'bf16-mixed'"
    ):
        _fit(MemoryBudget(knobs={"precision": "32-true"}), tmp_path, precision="bf16-mixed")


@pytest.mark.slow
@pytest.mark.distributed
def test_under_fsdp_memopt_the_plan_shards_over_the_ranks_and_sets_the_strategy_offload(tmp_path):
    script = Path(__file__).with_name("memory_budget_fsdp_run.py")
    result = run_script(script, [str(tmp_path), "2.5", "2"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1))
    assert rank0["planned_here"] and not rank1["planned_here"] and rank0["knobs"] == rank1["knobs"]
    assert rank0["knobs"]["shards"] == 2 and rank0["knobs"]["cpu_offload"]  # 2.5 MiB: shards and offload both
    for rank in (rank0, rank1):
        assert rank["cpu_offload"] and rank["steps"] == 2
        assert abs(rank["local_elements"] - rank["elements"] / 2) < rank["elements"] * 0.01


def _ddp_ranks(tmp_path, budget_mib, *measure):
    script = Path(__file__).with_name("memory_budget_ddp_run.py")
    result = run_script(script, [str(tmp_path), str(budget_mib), *measure], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.slow
def test_under_ddp_rank_0_plans_and_every_rank_applies_its_plan(tmp_path):
    rank0, rank1 = _ddp_ranks(tmp_path, 7.5)  # bf16 alone does not fit: the plan checkpoints
    assert rank0["planned_here"] and not rank1["planned_here"]
    assert rank0["knobs"] == rank1["knobs"] and rank0["knobs"]["checkpoint"] != "none"
    assert rank0["applied"] == rank1["applied"]
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_under_ddp_every_rank_runs_the_trials_an_out_of_memory_on_rank_1_alone_counts_on_both_and_the_fit_is_exact(
    tmp_path,
):
    rank0, rank1 = _ddp_ranks(tmp_path, 7.5, "measure")  # rank 1's first trial runs out of memory, rank 0's fits
    outcomes = [outcome for _, outcome in rank0["measured"]]
    assert outcomes[0] == "out of memory" and "measured" in outcomes
    assert rank0["knobs"] == rank1["knobs"] and rank0["knobs"] != rank0["measured"][0][0]
    assert rank1["measured"] == [] and not rank1["planned_here"]
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))
    (tmp_path / "given").mkdir()
    given, _ = _ddp_ranks(tmp_path / "given", 7.5, json.dumps(rank0["knobs"]))  # the same fit, given those knobs
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], given["params"], strict=True))


@pytest.mark.slow
def test_under_ddp_a_failed_plan_stops_every_rank_with_its_message(tmp_path):
    rank0, rank1 = _ddp_ranks(tmp_path, 1.0)
    assert rank0["error"] == rank1["error"]
    assert "smaller than the model states alone" in rank0["error"]


def test_the_applied_callbacks_are_owned_not_added_to_the_trainer(tmp_path):
    budget = MemoryBudget(knobs={"precision": "bf16-mixed", "checkpoint": "full", "micro_batch_size": 2})
    trainer = quiet_trainer(max_steps=2, callbacks=[budget], default_root_dir=tmp_path)
    before = list(trainer.callbacks)
    trainer.fit(_module(), train_dataloaders=_loader())
    assert trainer.callbacks == before and not any(isinstance(c, APPLIED) for c in trainer.callbacks)
    assert [type(c) for c in budget.applied] == [AdaptiveAccumulation, PrecisionSwitch, ActivationCheckpointing]
    accumulation, switch, checkpointing = budget.applied
    assert accumulation.last_micro_batch_size == 2 and switch.base_precision == "bf16-mixed"  # their hooks ran
    assert checkpointing.report is not None
    path = tmp_path / "new.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    assert set(saved) & {"AdaptiveAccumulation", "PrecisionSwitch"} == set()
    assert set(saved[budget.state_key]["applied"]) == {"AdaptiveAccumulation", "PrecisionSwitch"}
    assert saved[budget.state_key]["applied"]["AdaptiveAccumulation"] == accumulation.state_dict()


def test_a_checkpoint_of_the_earlier_layout_restores_the_applied_callbacks(tmp_path, monkeypatch):
    knobs = {"precision": "bf16-mixed", "micro_batch_size": 2}
    trainer = quiet_trainer(max_steps=2, callbacks=[MemoryBudget(knobs=knobs)], default_root_dir=tmp_path)
    trainer.fit(_module(), train_dataloaders=_loader())
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    # the layout MemoryBudget wrote when its callbacks were the Trainer's own: their states under their own keys
    checkpoint = torch.load(path, weights_only=False)
    states = checkpoint["callbacks"]
    old = states["MemoryBudget"].pop("applied")
    assert states["MemoryBudget"] == {"knobs": Knobs(**knobs).as_dict()} and set(old) == {
        "AdaptiveAccumulation",
        "PrecisionSwitch",
    }
    old["AdaptiveAccumulation"].update(size=1, oom_recoveries=3)  # as if it had recovered from 3 OOMs at size 1
    states.update(old)
    torch.save(checkpoint, path)
    loaded = {}
    for cls in (AdaptiveAccumulation, PrecisionSwitch):
        original = cls.load_state_dict

        def spy(self, state, original=original):
            loaded[type(self).__name__] = state
            original(self, state)

        monkeypatch.setattr(cls, "load_state_dict", spy)
    resumed = MemoryBudget(knobs=knobs)
    trainer = quiet_trainer(max_steps=3, callbacks=[resumed], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="Please add the following callbacks") as warned:  # Lightning's, harmless
        trainer.fit(_module(), train_dataloaders=_loader(), ckpt_path=path)
    (lightning_warning,) = [w for w in warned if "Please add the following callbacks" in str(w.message)]
    assert "AdaptiveAccumulation" in str(lightning_warning.message)
    assert trainer.global_step == 3
    assert loaded == old
    accumulation = resumed.applied[0]
    assert accumulation.last_micro_batch_size == 1 and accumulation.state_dict()["oom_recoveries"] == 3


def test_planned_ahead_the_plan_is_applied_in_setup_without_planning_again(tmp_path, monkeypatch):
    budget = MemoryBudget(budget=9.0 / 1024)
    images, normals = BATCH
    batch = {"image": images, "normal": normals, "mask": torch.ones(4, 1, 64, 48, dtype=torch.bool)}
    module = _module()
    knobs = budget.plan_ahead(module, batch)
    assert knobs is not None and knobs == budget.plan.chosen.knobs and budget.knobs is None
    plans = []
    monkeypatch.setattr(memory_budget, "plan_for_target", lambda *args, **kwargs: plans.append(args))
    monkeypatch.setattr(memory_budget, "training_dataloader", lambda trainer: pytest.fail("read the Trainer's loader"))
    trainer = quiet_trainer(max_steps=1, callbacks=[budget], default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=_loader())
    assert budget.knobs == knobs and not plans and trainer.global_step == 1
    with pytest.raises(MisconfigurationException, match="`knobs` 'bf16-mixed' were given: no plan"):
        MemoryBudget(knobs={"precision": "bf16-mixed"}).plan_ahead(module, batch)


def test_planned_ahead_for_another_trainer_the_plan_is_made_again_in_setup(tmp_path, caplog):
    budget = MemoryBudget(budget=1.0, gpu="a100_80gb")
    images, normals = BATCH
    batch = {"image": images, "normal": normals, "mask": torch.ones(4, 1, 64, 48, dtype=torch.bool)}
    budget.plan_ahead(_module(), batch, precision="bf16-mixed")  # the Trainer will run 32-true
    trainer = quiet_trainer(max_steps=1, callbacks=[budget], default_root_dir=tmp_path)
    with caplog.at_level("INFO"):
        trainer.fit(_module(), train_dataloaders=_loader())
    assert "planned ahead for 1 rank, the Trainer at bf16-mixed, on cpu, but the Trainer runs 1 rank, on cpu" in (
        caplog.text
    )
    assert budget.knobs == budget.plan.chosen.knobs and trainer.global_step == 1


class _DropoutNet(pl.LightningModule):
    """A small CNN drawing random numbers in its step (dropout), on a loader drawing none of its own."""

    def __init__(self):
        super().__init__()
        layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Flatten()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(8 * 16 * 16, 4))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_dropout_net(budget_callback, tmp_path):
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(48, 3, 16, 16, generator=generator), torch.randint(0, 4, (48,), generator=generator)
    torch.manual_seed(0)
    module = _DropoutNet()
    trainer = quiet_trainer(max_steps=6, callbacks=[budget_callback], default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(list(zip(images, labels, strict=True)), batch_size=8)
    trainer.fit(module, train_dataloaders=loader)
    return module


def test_planning_leaves_the_random_numbers_of_the_run_as_the_chosen_knobs_given_from_the_start(tmp_path):
    """Fetching the batch to plan with starts a loader iterator, which draws its seed from torch's generator, and
    timing this CPU draws its inputs: the run after planning drew other dropout masks (1.5e-2 apart after 6 steps)."""
    planned = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0)
    trained = _fit_dropout_net(planned, tmp_path)
    given = _fit_dropout_net(MemoryBudget(knobs=planned.knobs.as_dict()), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), given.parameters(), strict=True))


def test_measured_plans_choose_the_fastest_measured_that_fits_and_leave_the_run_as_given_those_knobs(tmp_path):
    measured = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure=True, measure_candidates=3)
    trained = _fit_dropout_net(measured, tmp_path)
    plan = measured.plan
    assert len(plan.measurements) == 3 and plan.measure_seconds > 0
    fitting = [m for m in plan.measurements if m.outcome == "measured" and m.measured_peak_bytes <= plan.limit_bytes]
    assert fitting and measured.knobs == min(fitting, key=lambda m: m.measured_seconds).knobs
    assert "tried 3 of 3 candidates on the device" in plan.measured_report(None)
    given = _fit_dropout_net(MemoryBudget(knobs=measured.knobs.as_dict()), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), given.parameters(), strict=True))


def test_auto_measures_off_the_cpu_only(tmp_path):
    budget = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0)
    _fit_dropout_net(budget, tmp_path)
    assert budget.plan.measurements == [] and budget.plan.measure_seconds is None


def test_a_trial_out_of_memory_ends_that_trial_alone_and_the_run_trains_what_fits(tmp_path):
    budget = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure="refresh")  # not an earlier test's
    with SimulatedDevice(450 * 1024) as device:  # 32-true's step needs more; the rest fit
        module = _fit_dropout_net(budget, tmp_path)
    outcomes = {m.knobs.describe(): m.outcome for m in budget.plan.measurements}
    assert outcomes["32-true"] == "out of memory" and device.oom_count == 1
    assert budget.knobs.describe() != "32-true" and outcomes[budget.knobs.describe()] == "measured"
    assert module.trainer.global_step == 6


def test_when_every_trial_runs_out_of_memory_the_least_predicted_peak_trains_under_adaptive_accumulation(
    tmp_path, caplog
):
    budget = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure="refresh")  # not an earlier test's
    with SimulatedDevice(340 * 1024):
        module = _fit_dropout_net(budget, tmp_path)
    assert not any(m.fits(budget.plan.limit_bytes) for m in budget.plan.measurements)
    fitting = [c for c in budget.plan.candidates if c.fits]
    assert budget.knobs == min(fitting, key=lambda c: c.peak_bytes).knobs
    assert "nothing measured fits" in caplog.text
    accumulation = next(c for c in budget.callbacks if isinstance(c, AdaptiveAccumulation))
    assert accumulation.sizer.size < budget.knobs.micro_batch_size and module.trainer.global_step == 6


def test_a_rerun_of_the_same_model_batch_and_device_measures_nothing_and_refresh_measures_again(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    first = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure=True, measure_candidates=3)
    _fit_dropout_net(first, tmp_path)
    assert (tmp_path / "cache" / "measurements.json").is_file()
    assert not any(m.remembered for m in first.plan.measurements)
    again = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure=True, measure_candidates=3)
    _fit_dropout_net(again, tmp_path)
    assert [(m.knobs, m.measured_seconds, m.measured_peak_bytes) for m in again.plan.measurements] == [
        (m.knobs, m.measured_seconds, m.measured_peak_bytes) for m in first.plan.measurements
    ]
    assert all(m.remembered for m in again.plan.measurements) and again.knobs == first.knobs
    assert "tried 0 of 3 candidates on the device" in caplog.text and "3 remembered from an earlier run" in caplog.text
    refreshed = MemoryBudget(budget=0.5 / 1024, safety_margin=0.0, measure="refresh", measure_candidates=3)
    _fit_dropout_net(refreshed, tmp_path)
    assert not any(m.remembered for m in refreshed.plan.measurements)
