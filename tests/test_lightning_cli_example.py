"""examples/lightning_cli.py: LightningCLI with the project's task, datamodules, callbacks and strategies.

Every form docs/guide/lightning-cli.md shows is tried here: the YAML config, strategies by registered
name and by class path (``--trainer.strategy.class_path=…``, a ``{class_path, init_args}`` value, a
config's ``init_args`` overridden), callbacks appended by class path (``--trainer.callbacks+=…``).
"""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

pytest.importorskip("jsonargparse")

from lightning_memopt.callbacks import (  # noqa: E402
    ActivationCheckpointing,
    AdaptiveAccumulation,
    LastCheckpoint,
    MemoryMonitor,
    PrecisionSwitch,
    TrainingSummary,
)
from lightning_memopt.data import ImageFolderFaceDataModule  # noqa: E402
from lightning_memopt.strategies import MemoptDDPStrategy, MemoptFSDPStrategy  # noqa: E402
from tests.helpers import REPO_ROOT, run_python, run_script, write_face_folder  # noqa: E402

SCRIPT = REPO_ROOT / "examples" / "lightning_cli.py"
CONFIG = REPO_ROOT / "examples" / "lightning_cli.yaml"
# the face data and model shrunk to a CPU run of a few seconds (as tests/helpers.py TINY_FACE)
TINY = [
    "--model.backbone=iresnet_tiny",
    "--model.backbone_options={input_size: 32}",
    "--model.warmup_steps=0",
    "--data.image_size=32",
    "--data.num_classes=8",
    "--data.samples_per_class=4",
    "--data.val_samples_per_class=1",
    "--data.batch_size=8",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    """The script's own command line (LightningCLI warns when ``args`` comes with one, pytest's, in ``sys.argv``)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])


@pytest.fixture(scope="module")
def example():
    """The example's ``main(args, run)``, loaded from its file (``examples`` is no package)."""
    return runpy.run_path(str(SCRIPT), run_name="lightning_cli_example")["main"]


def build(example, tmp_path, *args: str):
    """The LightningCLI of ``args`` after the config and TINY, with everything built and nothing run."""
    return example([f"--config={CONFIG}", *TINY, f"--trainer.default_root_dir={tmp_path}", *args], run=False)


def test_the_config_builds_the_strategy_and_callbacks_by_class_path(example, tmp_path):
    cli = build(example, tmp_path)
    assert type(cli.trainer.strategy) is MemoptDDPStrategy and cli.trainer.strategy.comm_hook_name == "none"
    ours = [type(c) for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_memopt")]
    assert ours == [MemoryMonitor, ActivationCheckpointing, PrecisionSwitch, AdaptiveAccumulation]
    assert cli.model.hparams.num_classes == cli.datamodule.num_classes == 8  # linked from the built datamodule


@pytest.mark.parametrize(
    ("args", "strategy", "comm_hook"),
    [
        (["--trainer.strategy=ddp_memopt"], MemoptDDPStrategy, "none"),
        (["--trainer.strategy=ddp_powersgd"], MemoptDDPStrategy, "powersgd"),
        (["--trainer.strategy=ddp_fp16_compress"], MemoptDDPStrategy, "fp16"),
        (["--trainer.strategy=ddp_bf16_compress"], MemoptDDPStrategy, "bf16"),
        (["--trainer.strategy=fsdp_memopt"], MemoptFSDPStrategy, None),
        (
            [
                "--trainer.strategy.class_path=lightning_memopt.strategies.MemoptDDPStrategy",
                "--trainer.strategy.init_args.comm_hook=allreduce",
            ],
            MemoptDDPStrategy,
            "allreduce",
        ),
        (["--trainer.strategy.comm_hook=bf16"], MemoptDDPStrategy, "bf16"),  # the config's init_args, overridden
        (
            [
                "--trainer.strategy={class_path: lightning_memopt.strategies.MemoptFSDPStrategy,"
                " init_args: {cpu_offload: true}}"
            ],
            MemoptFSDPStrategy,
            None,
        ),
    ],
    ids=[
        "ddp_memopt",
        "ddp_powersgd",
        "ddp_fp16_compress",
        "ddp_bf16_compress",
        "fsdp_memopt",
        "class_path",
        "init_args",
        "mapping",
    ],  # fmt: skip
)
def test_strategies_by_name_and_by_class_path(example, tmp_path, args, strategy, comm_hook):
    chosen = build(example, tmp_path, *args).trainer.strategy
    assert type(chosen) is strategy
    if comm_hook is not None:
        assert chosen.comm_hook_name == comm_hook
    if "cpu_offload: true" in args[0]:
        assert chosen.cpu_offload is True


def test_an_image_folder_gives_the_model_its_number_of_classes(example, tmp_path):
    write_face_folder(tmp_path / "faces", {"alice": 2, "bob": 2, "carol": 2}, size=(32, 32))
    cli = build(
        example,
        tmp_path,
        "--data=lightning_memopt.data.ImageFolderFaceDataModule",
        f"--data.root={tmp_path / 'faces'}",
        "--data.num_classes=null",  # counted from the folders, not the config's synthetic count
        "--data.batch_size=2",
    )
    assert type(cli.datamodule) is ImageFolderFaceDataModule
    assert cli.model.hparams.num_classes == cli.datamodule.num_classes == 3


def test_importing_the_callbacks_registers_the_strategy_names(tmp_path):
    # (what makes `--trainer.callbacks+=lightning_memopt.callbacks.X` enough for the names; a fresh interpreter)
    check = (
        "import lightning_memopt.callbacks; from lightning.pytorch.strategies import StrategyRegistry; "
        "names = ('ddp_memopt', 'ddp_powersgd', 'ddp_fp16_compress', 'ddp_bf16_compress', 'fsdp_memopt'); "
        "assert all(name in StrategyRegistry for name in names), sorted(StrategyRegistry)"
    )
    result = run_python(["-c", check], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_callbacks_appended_by_class_path(example, tmp_path):
    cli = build(
        example,
        tmp_path,
        "--trainer.callbacks+=lightning_memopt.TrainingSummary",
        "--trainer.callbacks+=lightning_memopt.callbacks.LastCheckpoint",
        "--trainer.callbacks.filename=final.ckpt",
    )
    added = [c for c in cli.trainer.callbacks if isinstance(c, TrainingSummary | LastCheckpoint)]
    assert [type(c) for c in added] == [TrainingSummary, LastCheckpoint] and added[1].filename == "final.ckpt"


def test_a_bad_name_is_refused_listing_the_choices(example, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        build(example, tmp_path, "--model.optimizer=adam")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "model.optimizer" in error and "'sgd'" in error and "'adamw'" in error


def test_help_of_a_callback_lists_its_choices(example, capsys):
    with pytest.raises(SystemExit) as exit_:
        example(["fit", "--trainer.callbacks.help", "lightning_memopt.PrecisionSwitch"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "{step,epoch}" in text and "'bf16-mixed'" in text


def test_fits_from_the_command_line_with_a_strategy_name_and_callbacks_by_class_path(example, tmp_path):
    # no config: the datamodule by class path, the strategy by its registered name, the callbacks appended
    cli = example(
        [
            "fit",
            "--data=lightning_memopt.data.SyntheticFaceDataModule",
            *TINY,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
            "--trainer.strategy=ddp_memopt",
            "--trainer.callbacks+=lightning_memopt.MemoryMonitor",
            "--trainer.callbacks.every_n_steps=1",
            "--trainer.callbacks+=lightning_memopt.ActivationCheckpointing",
            "--trainer.callbacks.policy=selective",
        ]
    )
    assert type(cli.trainer.strategy) is MemoptDDPStrategy
    assert cli.trainer.global_step == 2
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, MemoryMonitor))
    assert monitor.last_logged  # memopt/* figures of a sampled step
    checkpointing = next(c for c in cli.trainer.callbacks if isinstance(c, ActivationCheckpointing))
    assert checkpointing.report is not None and checkpointing.policies[0].mode == "selective"
    assert (tmp_path / "config.yaml").read_text().count("lightning_memopt.") >= 3  # the run's config, class paths


@pytest.mark.slow
def test_the_script_trains_with_the_config(tmp_path):
    result = run_script(
        SCRIPT, ["fit", f"--config={CONFIG}", *TINY, f"--trainer.default_root_dir={tmp_path}"], tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in output
    assert "ActivationCheckpointing: wrapped" in output and "PrecisionSwitch: bf16-mixed on cpu" in output
    (checkpoint,) = tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == 2
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: lightning_memopt.strategies.MemoptDDPStrategy" in saved
    assert "class_path: lightning_memopt.PrecisionSwitch" in saved
