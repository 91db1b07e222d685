import re
from dataclasses import replace

import pytest
import torch

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import SimulatedDevice
from lightning_memopt.memory.work import Work
from lightning_memopt.models import create_model
from lightning_memopt.models.structure import set_attention
from lightning_memopt.planner import GPUS, Knobs, PlanError, ResultChangingOption, gpu, measure_cpu, plan, with_budget
from lightning_memopt.planner.cost import step_cost
from lightning_memopt.planner.hardware import HOST_REGION_SECONDS
from tests.helpers import tensors_only

_MIB = 2**20
BATCH = torch.randn(4, 3, 64, 48)


def _model():
    return create_model("sapiens_tiny")


def _loss(model, batch):
    return model(batch).square().mean()


def _optimizer(parameters):
    return torch.optim.AdamW(parameters)


def _plan(budget_mib, **options):
    hardware = tensors_only(with_budget(gpu("a100_80gb"), budget_mib / 1024))
    return plan(_model, BATCH, hardware, loss_fn=_loss, optimizer=_optimizer, **options)


def _real_peak(knobs: Knobs, budget_bytes: int) -> int:
    """Train two real CPU steps with ``knobs`` inside a SimulatedDevice of the budget (it raises past it)."""
    with SimulatedDevice(budget_bytes) as device:
        model = _model()
        set_attention(model, knobs.attn_impl)
        if knobs.checkpoint_policy() is not None:
            apply_activation_checkpointing(model, knobs.checkpoint_policy())
        optimizer = _optimizer(model.parameters())
        size = knobs.micro_batch_size or len(BATCH)
        for _ in range(2):
            for micro in BATCH.split(size):
                with torch.autocast("cpu", torch.bfloat16, enabled=knobs.precision == "bf16-mixed"):
                    loss = _loss(model, micro) * len(micro) / len(BATCH)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return device.peak.total_bytes


def test_a_roomy_budget_gets_the_fastest_configuration_without_checkpointing():
    result = _plan(64.0)
    assert result.chosen is not None and result.chosen.knobs.checkpoint == "none"
    assert result.chosen.how == "profiled" and result.chosen.fits
    # every other group is skipped by the lower bound or profiled: nothing fitting is cheaper
    cheaper = [c for c in result.candidates if c.fits and c.cost.total < result.chosen.cost.total]
    assert not cheaper


@pytest.mark.parametrize(
    "budget_mib", [8.0, pytest.param(6.0, marks=pytest.mark.slow), pytest.param(5.5, marks=pytest.mark.slow), 4.5]
)
def test_a_tight_budget_gets_a_plan_whose_real_peak_fits_and_uses_most_of_it(budget_mib):
    result = _plan(budget_mib, cpu_offload=(False,))  # (an offloaded plan runs under fsdp_memopt: see tests/planner)
    assert result.chosen is not None, result.table()
    assert result.chosen.peak_bytes <= result.limit_bytes
    real = _real_peak(result.chosen.knobs, int(budget_mib * _MIB))  # would raise an OOM past the budget
    assert real <= budget_mib * _MIB
    assert real >= 0.7 * budget_mib * _MIB, result.table()


@pytest.mark.slow
def test_checkpointing_estimates_are_close_to_their_profiles():
    result = _plan(5.0, verify=10)
    # (sharded and offloaded ones hold no model states in their step's peak: the same bytes off are a larger share)
    confirmed = [c for c in result.candidates if c.estimated_bytes is not None and not c.knobs.sharding.active]
    assert confirmed
    # within 5% under (a plan that may not fit) and 20% over (a wasted budget: per-block mixes of offload and full
    # checkpointing count each offloaded block's largest op as held again in its backward, up to 18% over)
    for candidate in confirmed:
        error = (candidate.estimated_bytes - candidate.peak_bytes) / candidate.peak_bytes
        assert -0.05 <= error <= 0.20, candidate


def test_micro_batching_is_left_out_when_the_loss_couples_the_batch():
    def coupled():
        model = _model()
        model.batch_coupled_loss = True
        return model

    result = plan(coupled, BATCH, with_budget(gpu("a100_80gb"), 5.0 / 1024), loss_fn=_loss, optimizer=_optimizer)
    assert all(c.knobs.micro_batch_size is None for c in result.candidates)
    assert "micro-batching not considered" in result.table()


def test_several_gpus_add_sharded_and_offloaded_candidates_of_every_profiled_step():
    result = _plan(4.5, devices=4)
    layouts = {(c.knobs.shards, c.knobs.cpu_offload) for c in result.candidates}
    assert layouts == {(shards, offload) for shards in (1, 2, 4) for offload in (False, True)}
    unsharded = {c.knobs: c for c in result.candidates if c.how == "profiled" and not c.knobs.sharding.active}
    for candidate in result.candidates:
        if candidate.how == "sharded":  # predicted from the profiled unsharded step with the same knobs
            source = unsharded[replace(candidate.knobs, shards=1, cpu_offload=False)]
            assert candidate.peak_bytes < source.peak_bytes
            states = ("optimizer_state", "gradients")
            sharded = sum(candidate.estimate.phases["optimizer"][k] for k in states)
            whole = sum(source.estimate.phases["optimizer"][k] for k in states)
            assert sharded == 0 if candidate.knobs.cpu_offload else sharded < whole / candidate.knobs.shards * 1.1
            # offloaded activations (per-block offload) are on the host either way; the states only with cpu_offload
            assert (candidate.host_bytes > source.host_bytes) == candidate.knobs.cpu_offload
            assert candidate.cost.communication > 0 or candidate.knobs.shards == 1


def test_a_budget_below_the_model_states_is_refused_with_the_breakdown_and_the_options():
    option = ResultChangingOption("patch_size 16 → 32", "leaves the pre-trained weights", ("x=1",))
    with pytest.raises(PlanError) as error:
        _plan(2.0, options=[option], cpu_offload=(False,))
    message = str(error.value)
    for part in ("parameters", "gradients", "optimizer_state", "patch_size 16 → 32", "leaves the pre-trained"):
        assert part in message


@pytest.mark.slow
def test_offload_plans_below_the_model_states_and_is_refused_only_below_the_units_in_flight():
    result = _plan(2.0)  # the model states (3.5 MiB) do not fit: the device keeps only the units in flight
    assert result.chosen is not None and result.chosen.knobs.cpu_offload, result.table()
    assert result.chosen.host_bytes > 3 * _MIB and "host" in result.table()
    with pytest.raises(PlanError, match=r"CPU offload: +0\.\d\d MiB per GPU and 3\.\d\d MiB of host memory"):
        _plan(0.05)


def test_options_are_measured_against_the_chosen_knobs():
    def shallow():
        return create_model("sapiens_tiny", depth=1)

    option = ResultChangingOption("depth 2 → 1", "a smaller network", ("model.backbone_options.depth=1",), shallow)
    result = _plan(64.0, options=[option])
    (measured,) = result.options
    assert measured.saving_bytes > 0
    assert measured.peak_bytes + measured.saving_bytes == result.chosen.peak_bytes
    assert "depth 2 → 1" in result.table()


@pytest.mark.parametrize("name", ["a6000", 3090, None, ["a100_80gb"], "A100_80GB"])
def test_unknown_gpu_lists_the_catalogue(name):
    with pytest.raises(
        ValueError, match=f"Unknown `gpu`={re.escape(repr(name))}; valid names: v100_16gb, v100_32gb"
    ) as error:
        gpu(name)
    assert all(name in str(error.value) for name in GPUS)


def test_catalogue_flags_bf16():
    assert gpu("v100_32gb").mixed_precision == "16-mixed" and gpu("t4_16gb").bf16 is False
    assert gpu("a800_80gb").mixed_precision == "bf16-mixed" and gpu("h200_141gb").memory_gib > 140


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"precision": "fp8"}, "Unknown `precision`='fp8'; valid choices: 32-true, bf16-mixed, 16-mixed"),
        ({"checkpoint": "half"}, "Unknown `checkpoint`='half'; valid choices: none, selective, full, offload"),
        ({"every_n": 0}, "`every_n` must be an integer ≥ 1, got 0"),
        ({"micro_batch_size": 0}, "`micro_batch_size` must be an integer ≥ 1, got 0"),
        ({"micro_batch_size": -8}, "`micro_batch_size` must be an integer ≥ 1, got -8"),
        ({"attn_impl": "flash"}, "Unknown `attn_impl`='flash'; valid choices: sdpa, math"),
        ({"shards": 0}, "`shards` must be an integer ≥ 1, got 0"),
        ({"cpu_offload": "maybe"}, "`cpu_offload` must be true or false, got 'maybe' (str)"),
    ],
)
def test_bad_knobs_are_named(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Knobs(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"shards": True}, "`shards` must be an integer ≥ 1, got True (bool)"),
        ({"every_n": "2"}, "`every_n` must be an integer ≥ 1, got '2' (str)"),
        ({"micro_batch_size": 1.5}, "`micro_batch_size` must be an integer ≥ 1, got 1.5 (float)"),
    ],
)
def test_knobs_of_the_wrong_type_are_named(arguments, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        Knobs(**arguments)


def test_knobs_read_words_and_whole_floats():
    knobs = Knobs(every_n=2.0, shards=4.0, cpu_offload="on", micro_batch_size=8.0)
    assert knobs == Knobs(every_n=2, shards=4, cpu_offload=True, micro_batch_size=8)
    assert Knobs(cpu_offload="off").cpu_offload is False and Knobs(cpu_offload="yes").cpu_offload is True
    assert Knobs.from_mapping({"precision": "bf16-mixed", "shards": 2}) == Knobs("bf16-mixed", shards=2)
    with pytest.raises(ValueError, match=r"Unknown `knobs` fields \['layers'\]; valid fields: precision, attn_impl"):
        Knobs.from_mapping({"layers": 2})
    with pytest.raises(TypeError, match=r"`knobs` must be a mapping of precision, .*, got 'full' \(str\)"):
        Knobs.from_mapping("full")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"safety_margin": 1.5}, ValueError, "`safety_margin` must be a number ≥ 0 and < 1, got 1.5"),
        ({"safety_margin": -0.1}, ValueError, "`safety_margin` must be a number ≥ 0 and < 1, got -0.1"),
        ({"safety_margin": "abc"}, TypeError, "`safety_margin` must be a number ≥ 0 and < 1, got 'abc' (str)"),
        ({"devices": 0}, ValueError, "`devices` must be an integer ≥ 1, got 0"),
        ({"devices": "4"}, TypeError, "`devices` must be an integer ≥ 1, got '4' (str)"),
        ({"devices": True}, TypeError, "`devices` must be an integer ≥ 1, got True (bool)"),
        ({"verify": -1}, ValueError, "`verify` must be an integer ≥ 0, got -1"),
        ({"devices": 4, "shards": [1, 8]}, ValueError, "`shards` entry 8 must be an int from 1 to `devices`=4"),
        ({"devices": 4, "shards": 4}, ValueError, "`shards` must be a non-empty sequence (a list or tuple), got 4"),
        ({"cpu_offload": ()}, ValueError, "`cpu_offload`=() must be a non-empty sequence of True / False"),
        ({"cpu_offload": True}, ValueError, "`cpu_offload`=True must be a non-empty sequence of True / False"),
        ({"cpu_offload": ["maybe"]}, ValueError, "`cpu_offload` must be true or false, got 'maybe' (str)"),
        ({"precisions": ["fp8"]}, ValueError, "`precisions` entry 'fp8' is not one of ['32-true', 'bf16-mixed'"),
        ({"precisions": "bf16-mixed"}, ValueError, "`precisions` must be a non-empty sequence (a list or tuple)"),
        ({"attn_impls": ["flash"]}, ValueError, "`attn_impls` entry 'flash' is not one of ['sdpa', 'math', None]"),
        ({"micro_batching": "maybe"}, ValueError, "`micro_batching` must be true, false or null, got 'maybe'"),
        ({"gather_as_stored": "maybe"}, ValueError, "`gather_as_stored` must be true or false, got 'maybe'"),
        ({"options": ["smaller"]}, TypeError, "`options` entry 'smaller' must be a ResultChangingOption"),
    ],
)
def test_bad_plan_arguments_are_named(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _plan(8.0, **options)


@pytest.mark.parametrize(
    ("hardware", "budget", "error", "message"),
    [
        (gpu("t4_16gb"), 0, ValueError, "`budget` must be a number > 0, got 0"),
        (gpu("t4_16gb"), -2, ValueError, "`budget` must be a number > 0, got -2"),
        (gpu("t4_16gb"), "abc", TypeError, "`budget` must be a number > 0, got 'abc' (str)"),  # memopt-plan budget=abc
        (gpu("t4_16gb"), True, TypeError, "`budget` must be a number > 0, got True (bool)"),
        ("t4_16gb", 8, TypeError, "`hardware` must be a Hardware (gpu(name), cuda_hardware(device)"),
    ],
)
def test_bad_budgets_are_named(hardware, budget, error, message):
    with pytest.raises(error, match=re.escape(message)):
        with_budget(hardware, budget)


def test_plan_refuses_a_name_where_an_object_is_wanted():
    with pytest.raises(TypeError, match=re.escape("`hardware` must be a Hardware (gpu(name), with_budget(...)")):
        plan(_model, BATCH, "t4_16gb", loss_fn=_loss, optimizer=_optimizer)
    with pytest.raises(TypeError, match=re.escape("`loss_fn` must be a function or None, got 'mse' (str)")):
        plan(_model, BATCH, gpu("t4_16gb"), loss_fn="mse", optimizer=_optimizer)
    with pytest.raises(TypeError, match=re.escape("`model` must be an nn.Module or a function building one, got str")):
        plan("r18", BATCH, gpu("t4_16gb"), loss_fn=_loss, optimizer=_optimizer)


def test_the_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    _plan(8.0).write_chart(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_the_measured_cpu_prices_checkpointing_and_searches_math_attention():
    cpu = measure_cpu(2**20)
    assert cpu.kernel_seconds > 0 and not cpu.fused_attention_wins
    assert set(cpu.region_seconds) == {"full", "selective", "offload"}
    assert all(per_call >= 0 and per_op >= 0 for per_call, per_op in cpu.region_seconds.values())


def test_the_calibration_is_invisible_to_a_simulated_device_around_it():
    # MemoryBudget(budget=...) plans inside the SimulatedDevice it plans for: timing the host must not run it out
    with SimulatedDevice(2**20) as device:
        cpu = measure_cpu(2**20)
    assert cpu.memory_bytes == 2**20 and device.oom_count == 0 and device.peak.total_bytes == 0


def test_checkpointing_host_cost_is_per_block_call_and_per_forward_op_inside():
    hardware = replace(gpu("a100_80gb"), region_seconds={"full": (1e-3, 1e-5)})
    plain = step_cost(Work(kernels=100), Work(), hardware)
    full = step_cost(Work(kernels=100), Work(), hardware, micro_batches=1, regions={"full": (4, 50)})
    assert full.checkpointing == pytest.approx(4 * 1e-3 + 50 * 1e-5)
    assert full.total - plain.total == pytest.approx(full.checkpointing)
    catalogue = step_cost(Work(), Work(), gpu("a100_80gb"), regions={"full": (4, 0)})
    assert catalogue.checkpointing == pytest.approx(4 * HOST_REGION_SECONDS["full"][0]) and catalogue.checkpointing > 0
    hardware = replace(hardware, region_seconds={"full": (1e-3, 0.0), "offload": (2e-3, 0.0)})
    mixed = step_cost(Work(), Work(), hardware, micro_batches=2, regions={"full": (3, 0), "offload": (1, 0)})
    assert mixed.checkpointing == pytest.approx(2 * (3 * 1e-3 + 1 * 2e-3))  # each mode at its own price
