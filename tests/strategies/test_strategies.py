from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_memopt.data.loader_datamodule import ShardedEvaluationSampler, evaluation_sampler
from lightning_memopt.strategies import MemoptDDPStrategy, comm_hook
from lightning_memopt.strategies.powersgd_state import ResumablePowerSGD
from tests.helpers import run_script


@pytest.mark.parametrize(
    ("name", "hook"),
    [
        ("ddp_memopt", "none"),
        ("ddp_powersgd", "powersgd"),
        ("ddp_fp16_compress", "fp16"),
        ("ddp_bf16_compress", "bf16"),
    ],
)
def test_registered_names_build_the_presets(name, hook):
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, MemoptDDPStrategy) and strategy.comm_hook_name == hook
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MemoptDDPStrategy(comm_hook="zip"),
            r"Unknown `comm_hook`='zip'; valid choices: none, allreduce, fp16",
        ),
        (lambda: MemoptDDPStrategy(comm_hook=["fp16"]), r"Unknown `comm_hook`=\['fp16'\]; valid choices: none"),
        (lambda: MemoptDDPStrategy(powersgd_rank=0), r"`powersgd_rank` must be an integer ≥ 1, got 0"),
        (lambda: MemoptDDPStrategy(powersgd_rank=-4), r"`powersgd_rank` must be an integer ≥ 1, got -4"),
        (lambda: MemoptDDPStrategy(powersgd_rank="2"), r"`powersgd_rank` must be an integer ≥ 1, got '2' \(str\)"),
        (lambda: MemoptDDPStrategy(powersgd_rank=True), r"`powersgd_rank` must be an integer ≥ 1, got True \(bool\)"),
        (lambda: MemoptDDPStrategy(powersgd_warmup=1), r"`powersgd_warmup` must be an integer ≥ 2, got 1: PowerSGD"),
        (lambda: MemoptDDPStrategy(error_feedback="maybe"), r"`error_feedback` must be true or false, got 'maybe'"),
        (lambda: MemoptDDPStrategy(static_graph="maybe"), r"`static_graph` must be true, false or null, got 'maybe'"),
        (
            lambda: MemoptDDPStrategy(gradient_as_bucket_view=2),
            r"`gradient_as_bucket_view` must be true or false, got 2 \(int\)",
        ),
        (
            lambda: MemoptDDPStrategy(find_unused_parameters="sometimes"),
            r"`find_unused_parameters` must be true or false, got 'sometimes' \(str\)",
        ),
        (lambda: MemoptDDPStrategy(ddp_comm_hook=print), r"give `comm_hook` \(one of none, .*\), not `ddp_comm_hook`"),
        (lambda: MemoptDDPStrategy(model_averaging_period=4), "not `model_averaging_period`"),
    ],
)
def test_bad_input(build, message):
    with pytest.raises(MisconfigurationException, match=message) as caught:
        build()
    assert str(caught.value).startswith("MemoptDDPStrategy")


def test_flags_from_a_config_are_read_as_words():
    strategy = MemoptDDPStrategy(
        comm_hook="powersgd",
        powersgd_warmup=100.0,
        error_feedback="off",
        static_graph="no",
        gradient_as_bucket_view="false",
        find_unused_parameters="off",
    )
    assert strategy._powersgd_options == {"powersgd_rank": 1, "powersgd_warmup": 100, "error_feedback": False}
    assert strategy.static_graph is False and strategy._ddp_kwargs["gradient_as_bucket_view"] is False
    assert strategy._ddp_kwargs["find_unused_parameters"] is False


def test_comm_hook_by_name():
    model = torch.nn.Linear(3, 2)
    assert comm_hook("none", model) == (None, None)
    assert comm_hook("bf16", model)[1].__name__ == "bfloat16_allreduce_hook"
    state, hook = comm_hook("powersgd", model, powersgd_rank=3, powersgd_warmup=10, error_feedback=False)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.use_error_feedback) == (3, 10, False)
    assert isinstance(hook, ResumablePowerSGD) and hook.state is state
    with pytest.raises(ValueError, match=r"Unknown `comm_hook`='int8'"):
        comm_hook("int8", model)


def test_powersgd_state_moves_between_bucket_layouts_through_a_weights_only_checkpoint(tmp_path):
    """Saved from buckets [w1 b1 | w0 b0], placed again into one bucket [b0 w0 b1 w1]."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))  # w0 [6, 8] b0 w1 [5, 6] b1
    state = powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=2, random_seed=3)
    saved_hook = ResumablePowerSGD(state, model)
    saved_hook.layouts = {0: (2, 3), 1: (0, 1)}
    errors = {i: torch.randn(p.numel()) for i, p in enumerate(model.parameters())}
    state.error_dict = {0: torch.cat([errors[2], errors[3]]), 1: torch.cat([errors[0], errors[1]])}
    p_pieces, q_pieces = {0: torch.randn(6), 2: torch.randn(5)}, {0: torch.randn(8), 2: torch.randn(6)}  # rank 1
    state.p_memory_dict, state.q_memory_dict = {0: p_pieces[2], 1: p_pieces[0]}, {0: q_pieces[2], 1: q_pieces[0]}
    state.iter = 7
    state.rng.random_sample(5)
    torch.save(saved_hook.state_dict(), tmp_path / "state.pt")
    restored = ResumablePowerSGD(powersgd.PowerSGDState(None, start_powerSGD_iter=2, random_seed=0), model)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    restored._place(0, (1, 0, 3, 2), torch.zeros(1))
    placed = restored.state
    assert torch.equal(placed.error_dict[0], torch.cat([errors[1], errors[0], errors[3], errors[2]]))
    assert torch.equal(placed.p_memory_dict[0], torch.cat([p_pieces[0], p_pieces[2]]))
    assert torch.equal(placed.q_memory_dict[0], torch.cat([q_pieces[0], q_pieces[2]]))
    assert placed.iter == 7 and restored._pending is None
    assert placed.rng.random_sample(3).tolist() == state.rng.random_sample(3).tolist()


@pytest.mark.parametrize("size", [0, 1, 5, 7, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_evaluation_sampler_deals_each_sample_once(size, world):
    shards = [list(ShardedEvaluationSampler(range(size), num_replicas=world, rank=rank)) for rank in range(world)]
    assert sorted(index for shard in shards for index in shard) == list(range(size))
    assert [len(ShardedEvaluationSampler(range(size), num_replicas=world, rank=r)) for r in range(world)] == [
        len(shard) for shard in shards
    ]
    assert evaluation_sampler(range(size)) is None  # no process group here: in order


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_with_every_preset(tmp_path):
    script = Path(__file__).with_name("strategies_ddp_run.py")
    result = run_script(script, [str(tmp_path)], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for key, value in ranks[0].items():  # the ranks agree on everything
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(value, ranks[1][key], strict=True)), key

    def distance(key, other="ddp"):
        return max((a - b).abs().max().item() for a, b in zip(ranks[0][key], ranks[0][other], strict=True))

    assert ranks[0]["ddp_memopt/strategy"] == "MemoptDDPStrategy"
    assert distance("ddp_memopt") == 0.0  # buckets as views change nothing
    assert 0 < distance("ddp_fp16_compress") < 1e-3  # half precision on the wire: close, not equal
    assert 0 < distance("ddp_bf16_compress") < 1e-2
    assert distance("powersgd_lossless") < 1e-6  # a rank too high to compress: plain all-reduce
    iterations, before, after = ranks[0]["powersgd/compressed"]
    assert iterations == 12 and after < before / 5  # rank 1 compressed the matrices
    assert distance("powersgd_resumed", "powersgd") < 1e-6  # error feedback and factors restored
    assert distance("powersgd_stripped", "powersgd") > 1e-4  # without them the run differs
    assert ranks[0]["checkpoint_states"] == 2
    assert ranks[0]["checkpointed/static_graph"] is True and distance("checkpointed") < 1e-6
    seen = ranks[0]["validation_seen"] + ranks[1]["validation_seen"]
    assert sorted(seen) == list(range(11))  # 11 samples on 2 ranks: none repeated


def test_powersgd_pieces_are_each_parameters_factors_with_interleaved_shapes(tmp_path):
    """torch fills P / Q grouped by matrix shape: shapes A, B, A in one bucket must still cut right."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 8), torch.nn.Linear(8, 6))
    ddp = DistributedDataParallel(model)
    state, hook = comm_hook("powersgd", model, powersgd_warmup=2)
    ddp.register_comm_hook(state, hook)
    for _ in range(4):
        ddp.zero_grad()
        ddp(torch.randn(4, 8)).square().sum().backward()
    saved = hook.state_dict()
    assert sorted(saved["p"]) == [0, 2, 4]  # the three weights; the biases go uncompressed
    for index, parameter in enumerate(model.parameters()):
        if index in saved["p"]:
            rows = parameter.shape[0]
            p, q = saved["p"][index].view(rows, -1), saved["q"][index].view(-1, 1)
            torch.testing.assert_close(p @ q.T, parameter.grad.view(rows, -1))  # the gradient DDP delivered


def test_evaluation_sampler_leaves_a_set_smaller_than_the_world_to_lightning(tmp_path, monkeypatch):
    from lightning_memopt.data import loader_datamodule

    monkeypatch.setattr(loader_datamodule.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loader_datamodule.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(loader_datamodule.dist, "get_rank", lambda group=None: 1)
    assert loader_datamodule.evaluation_sampler(range(3)) is None  # a rank would get no batch
    assert list(loader_datamodule.evaluation_sampler(range(9))) == [1, 5]
