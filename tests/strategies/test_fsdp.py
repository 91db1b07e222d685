from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_memopt.cli.export import main as export_main
from lightning_memopt.models import create_model
from lightning_memopt.strategies import (
    MemoptFSDPStrategy,
    ShardingError,
    consolidate_checkpoint,
    mixed_precision_policy,
    shard_units,
)
from tests.helpers import quiet_trainer, run_memopt_train, run_script
from tests.strategies.strategies_ddp_run import MLP


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.fc1(x).relu())


def names(units):
    return [name for name, _ in units]


def test_the_registered_name_builds_fsdp2_with_its_defaults():
    strategy = StrategyRegistry.get("fsdp_memopt")
    assert isinstance(strategy, MemoptFSDPStrategy)
    assert (strategy.cpu_offload, strategy.reshard_after_forward, strategy.param_dtype) == (False, True, "auto")


def test_units_are_the_declared_blocks_then_the_root():
    model = create_model("sapiens_tiny", depth=3)
    units = shard_units(model)
    expected = [*model.backbone.blocks, *model.head.upsample, model.head.refine, model]  # the 1×1 chain: one unit
    assert [unit for _, unit in units] == expected
    assert names(units)[-1] == ""


def test_units_of_a_foreign_model_are_its_discovered_blocks():
    model = nn.Sequential(nn.Linear(2, 4), Layer(), Layer(), Layer())
    assert names(shard_units(model)) == ["1", "2", "3", ""]
    assert names(shard_units(model, blocks=["1", "3"])) == ["1", "3", ""]


def test_a_block_without_parameters_is_no_unit():
    model = create_model("cotracker2_tiny")  # its correlation block holds no parameters
    units = names(shard_units(model))
    assert "correlation" not in units and "fnet" in units


def test_a_lightning_module_is_sharded_by_its_children_and_container_items():
    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(2, 4), Layer(), Layer())
            self.heads = nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 2)])
            self.metric_like = nn.Identity()  # no parameters: no unit

    assert names(shard_units(Task())) == ["backbone.1", "backbone.2", "backbone", "heads.0", "heads.1"]
    fully_covered = Task()
    fully_covered.backbone = nn.Sequential(Layer(), Layer())
    assert names(shard_units(fully_covered)) == ["backbone.0", "backbone.1", "heads.0", "heads.1"]


def test_parameters_held_by_the_lightning_module_itself_are_refused():
    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.net = nn.Linear(2, 2)

    with pytest.raises(ShardingError, match=r"Task holds parameters directly \(scale\)"):
        shard_units(Task())
    with pytest.raises(ShardingError, match=r"`blocks`=\['nothing\.\*'\] match no module of Sequential"):
        shard_units(nn.Sequential(nn.Linear(2, 2)), blocks=["nothing.*"])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MemoptFSDPStrategy(param_dtype="fp8"),
            r"unknown `param_dtype`='fp8'; valid choices: auto, bf16, fp16",
        ),
        (lambda: MemoptFSDPStrategy(cpu_offload="maybe"), r"`cpu_offload` must be true or false, got 'maybe' \(str\)"),
        (lambda: MemoptFSDPStrategy(cpu_offload=None), r"`cpu_offload` must be true or false, got None"),
        (
            lambda: MemoptFSDPStrategy(reshard_after_forward=2),
            r"`reshard_after_forward` must be true or false, got 2 \(int\)",
        ),
        (
            lambda: MemoptFSDPStrategy(save_distributed_checkpoint="folder"),
            r"`save_distributed_checkpoint` must be true or false, got 'folder' \(str\)",
        ),
        (lambda: MemoptFSDPStrategy(blocks=12), r"`blocks`=12 must be 'auto'"),
        (lambda: MemoptFSDPStrategy(process_group_backend=5), r"`process_group_backend` must be a backend name"),
        (lambda: MemoptFSDPStrategy(timeout=30), r"`timeout` must be a datetime.timedelta or None, got 30 \(int\)"),
    ],
)
def test_bad_input(build, message):
    with pytest.raises(MisconfigurationException, match="^MemoptFSDPStrategy: " + message):
        build()


def test_the_config_flags_read_words_not_truthiness(compose_train):
    cfg = compose_train(
        "strategy=fsdp_memopt", "trainer.strategy.cpu_offload=off", "trainer.strategy.reshard_after_forward=no"
    )
    strategy = instantiate(cfg.trainer.strategy)
    assert strategy.cpu_offload is False and strategy.reshard_after_forward is False
    refused = compose_train("strategy=ddp_powersgd", "trainer.strategy.powersgd_rank=abc")
    with pytest.raises(Exception, match=r"MemoptDDPStrategy: `powersgd_rank` must be an integer ≥ 1, got 'abc'"):
        instantiate(refused.trainer.strategy)


@pytest.mark.parametrize(("word", "expected"), [("off", False), ("no", False), ("0", False), ("on", True), (1, True)])
def test_the_flags_read_words_not_truthiness(word, expected):
    strategy = MemoptFSDPStrategy(cpu_offload=word, reshard_after_forward=word, save_distributed_checkpoint=word)
    assert strategy.cpu_offload is expected and strategy.reshard_after_forward is expected
    assert strategy._save_distributed_checkpoint is expected


def test_the_mixed_precision_policy_follows_the_precision():
    assert mixed_precision_policy("auto", "bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision_policy("auto", "32-true") is None
    assert mixed_precision_policy("auto", "switchable") is None  # PrecisionSwitch's autocast decides
    assert mixed_precision_policy("fp32", "bf16-mixed") is None
    assert mixed_precision_policy("fp16", "32-true").reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="Unknown `param_dtype`='int8'"):
        mixed_precision_policy("int8")


def test_consolidating_something_else_says_what_it_is(tmp_path):
    (tmp_path / "file.ckpt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"file\.ckpt is not a sharded checkpoint .*: a file"):
        consolidate_checkpoint(tmp_path / "file.ckpt")
    with pytest.raises(FileNotFoundError, match=r"is not a sharded checkpoint .*: a folder"):
        consolidate_checkpoint(tmp_path)


class CallsInside(pl.LightningModule):
    """Its step calls the submodules of `net` one by one, never `net` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Module()
        self.net.stem, self.net.blocks, self.net.out = nn.Linear(2, 4), nn.Sequential(Layer(), Layer()), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net.out(self.net.blocks(self.net.stem(batch))).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_submodule_called_past_its_unit_is_explained_and_blocks_fix_it():
    loader = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    with pytest.raises(RuntimeError, match=r"a parameter was used while sharded .* units are net.blocks.0"):
        quiet_trainer(strategy=MemoptFSDPStrategy(), max_steps=1).fit(CallsInside(), loader)
    torch.distributed.destroy_process_group()
    strategy = MemoptFSDPStrategy(blocks=["net.stem", "net.blocks.*", "net.out"])
    quiet_trainer(strategy=strategy, max_steps=1).fit(CallsInside(), loader)
    assert strategy.units == ["net.stem", "net.blocks.0", "net.blocks.1", "net.out"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    result = run_script(Path(__file__).with_name("fsdp_run.py"), [str(out)], cwd=out, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out, [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _distance(first, second):
    return max((first[name] - second[name]).abs().max().item() for name in first)


@pytest.mark.distributed
def test_two_ranks_train_as_under_ddp_holding_half_the_parameters_each(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        for name in ("fsdp", "offload", "checkpointed"):  # clipped by norm: the norm spans every shard
            assert rank[name] == pytest.approx(rank["ddp"], abs=1e-5), name
        assert rank["normals/fsdp_memopt"] == pytest.approx(rank["normals/ddp"], abs=1e-5)
        assert _distance(rank["fsdp/parameters"], rank["ddp/parameters"]) < 1e-5
        assert _distance(rank["offload/parameters"], rank["ddp/parameters"]) < 1e-5
        assert rank["fsdp/units"] == ["net.1", "net.2", "net"]
    assert ranks[0]["fsdp"] != ranks[1]["fsdp"]  # each rank its own batches, as under DDP
    held = [rank["fsdp/elements"] for rank in ranks]
    assert sum(held) == ranks[0]["ddp/elements"] and max(held) - min(held) <= 48  # half each, to a row


@pytest.mark.distributed
def test_unclipped_plain_sgd_steps_match_ddp_in_gradients_and_parameters_at_every_step(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        fsdp, ddp = rank["steps/fsdp_memopt"], rank["steps/ddp"]
        assert len(ddp["gradients"]) == len(ddp["parameters"]) == 4
        torch.testing.assert_close(fsdp, ddp, rtol=1e-6, atol=0.0)  # names the step and parameter that differ
    inputs = [batch[0] for rank in ranks for batch in rank["steps/batches"]]
    assert len({tuple(batch.flatten().tolist()) for batch in inputs}) == 8  # a batch of its own per rank and step


@pytest.mark.distributed
def test_validation_runs_as_many_batches_on_every_rank(two_ranks):
    _, ranks = two_ranks
    seen = ranks[0]["validation_seen"] + ranks[1]["validation_seen"]
    assert len(ranks[0]["validation_seen"]) == len(ranks[1]["validation_seen"]) == 5  # one sample repeated
    assert sorted(set(seen)) == list(range(9))


@pytest.mark.distributed
def test_a_run_resumed_mid_epoch_continues_exactly_from_shards_or_one_file(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        straight = rank["straight/batches"]
        assert len({tuple(batch[0].flatten().tolist()) for batch in straight}) == 6
        for layout in ("sharded", "full"):  # the batches after step 3, not the epoch's first ones again
            torch.testing.assert_close(rank[f"resumed/{layout}/batches"], straight[3:], rtol=0, atol=0)
            assert rank[f"resumed/{layout}/losses"] == rank["straight/losses"][3:]
            assert _distance(rank[f"resumed/{layout}"], rank["straight"]) == 0.0


@pytest.mark.distributed
def test_the_consolidated_shards_load_into_the_plain_model(two_ranks, tmp_path, capsys):
    out, ranks = two_ranks
    checkpoint = consolidate_checkpoint(out / "sharded.ckpt", tmp_path / "whole.ckpt")
    plain = MLP()
    plain.load_state_dict(checkpoint["state_dict"])
    assert _distance(dict(plain.named_parameters()), ranks[0]["saved/sharded"]) == 0.0
    assert checkpoint["global_step"] == 3 and len(checkpoint["optimizer_states"]) == 1
    assert torch.load(tmp_path / "whole.ckpt", weights_only=False)["global_step"] == 3

    export_main([str(out / "normals.ckpt"), str(tmp_path / "sapiens.pth")])  # memopt-export reads the folder too
    assert "in the official Sapiens layout" in capsys.readouterr().out
    assert "backbone.patch_embed.projection.weight" in torch.load(tmp_path / "sapiens.pth", weights_only=True)


@pytest.mark.distributed
def test_cpu_offload_on_one_device_equals_the_plain_run(tmp_path):
    result = run_script(Path(__file__).with_name("fsdp_run.py"), [str(tmp_path), "single"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    single = torch.load(tmp_path / "single.pt", weights_only=False)
    assert single["offload"] == single["plain"]
    assert _distance(single["offload/parameters"], single["plain/parameters"]) == 0.0


@pytest.mark.slow
@pytest.mark.distributed
def test_memopt_train_shards_a_tiny_sapiens_over_two_cpu_ranks(tmp_path):
    args = ["experiment=sapiens_2b_normal", "model=sapiens_tiny", "model.warmup_steps=1", "data.image_size=[64,48]",
            "trainer=cpu", "trainer.max_steps=2", "trainer.limit_val_batches=1", "strategy=fsdp_memopt",
            "trainer.devices=2", "trainer.strategy.cpu_offload=true", f"paths.output_dir={tmp_path}"]  # fmt: skip
    result = run_memopt_train(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # 2 ViT blocks, 3 upsampling stages, the refine chain, the root
    assert "fsdp_memopt: 7 units over 2 ranks" in result.stdout + result.stderr
    assert "optimizer steps   2" in result.stdout


@pytest.mark.cuda
def test_fsdp_memopt_with_offload_trains_the_sapiens_preset_on_a_gpu(tmp_path):
    from torch.utils.data import DataLoader

    from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataset
    from lightning_memopt.tasks import NormalEstimationModule
    from tests.helpers import quiet_trainer

    module = NormalEstimationModule(backbone="sapiens_tiny", lr=2e-3, warmup_steps=0, schedule="constant")
    loader = DataLoader(SyntheticNormalsDataset(4, (64, 48), seed=0), batch_size=2)
    strategy = MemoptFSDPStrategy(cpu_offload=True)
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=2, precision="bf16-mixed")
    trainer.fit(module, loader)
    parameter = next(module.parameters())
    assert parameter.to_local().device.type == "cpu"  # the shards stay on the host
    assert all(buffer.device.type == "cuda" for buffer in module.buffers())
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
