"""Every config in conf/ composes with train.yaml, and what it describes can be built or run."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.train import train
from lightning_memopt.data import pack_image_folder
from tests.helpers import TINY_FACE, TINY_TRACKING, write_face_folder, write_normals_folder, write_tracking_folder

CONF = Path(config_dir())
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
RUNNABLE_GROUPS = {"precision", "strategy", "trainer", "logger", "memopt", "debug"}


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _all(groups):
    return [pytest.param(g, o, id=f"{g}={o}") for g in groups for o in _options(g)]


def test_the_config_tree_has_the_documented_groups():
    expected = {
        "model",
        "data",
        "strategy",
        "precision",
        "memopt",
        "trainer",
        "logger",
        "paths",
        "experiment",
        "sweep",
        "debug",
    }
    assert expected <= set(GROUPS)
    assert "none" in _options("memopt")


@pytest.fixture
def data_overrides(tmp_path):
    """Per data option, the overrides that shrink it and point it at small real files."""
    folder = tmp_path / "faces"
    write_face_folder(folder, {"alice": 2, "bob": 2}, size=(32, 32))
    pack_image_folder(folder, tmp_path / "packed")
    normals = write_normals_folder(tmp_path / "normals", count=2, size=(24, 32))
    clips = write_tracking_folder(tmp_path / "clips", count=2)
    loader = ["data.batch_size=2", "data.num_workers=0", "data.pin_memory=false", "data.persistent_workers=false"]
    face_files = ["data.num_classes=2", "data.image_size=32", *loader]
    return {
        "synthetic_face": [],
        "image_folder_face": [f"data.root={folder}", *face_files],
        "memmap_face": [f"data.path={tmp_path / 'packed'}", *face_files],
        "synthetic_normals": ["data.image_size=[32,24]", "data.num_samples=2", "data.batch_size=2"],
        "normals_folder": [f"data.root={normals}", "data.image_size=[32,24]", *loader],
        "synthetic_tracking": [o for o in TINY_TRACKING if o.startswith("data.")],
        "tracking_npz": [f"data.root={clips}", "data.sequence_len=8", "data.traj_per_sample=16", *loader],
    }


def _batch_size(batch):
    first = batch[0] if isinstance(batch, list | tuple) else next(iter(batch.values()))
    return first.shape[0]


@pytest.mark.parametrize(("group", "option"), _all(["data"]))
def test_every_data_config_gives_batches(compose_train, data_overrides, group, option):
    cfg = compose_train(f"data={option}", *data_overrides[option])
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert _batch_size(batch) == cfg.data.batch_size
    if "num_classes" in cfg.data:  # face data: (images, labels)
        images, labels = batch
        assert images.shape[1:] == (3, cfg.data.image_size, cfg.data.image_size)
        assert int(labels.max()) < datamodule.num_classes == cfg.data.num_classes


@pytest.mark.parametrize(("group", "option"), _all(["model"]))
def test_every_model_config_builds_its_module(compose_train, group, option):
    cfg = compose_train(f"model={option}")
    with torch.device("meta"):  # the r200 and Sapiens-2B models are described, not allocated
        model = instantiate(cfg.model)
    assert isinstance(model, pl.LightningModule) and model.hparams.backbone == option


def _needs_a_gpu(cfg):  # Lightning's own FSDP (FSDP1) refuses the CPU; fsdp_memopt (FSDP2) runs there
    fsdp1 = "lightning.pytorch.strategies.FSDPStrategy" in str(cfg.trainer.strategy)
    return not torch.cuda.is_available() and (cfg.trainer.accelerator == "gpu" or fsdp1)


# What an option needs to run here: no network (W&B offline), its store under the test's folder (MLflow)
_OFFLINE = {"wandb": ["logger.wandb.offline=true"], "mlflow": ["paths.log_dir={tmp_path}"]}


@pytest.mark.parametrize(("group", "option"), _all(sorted(RUNNABLE_GROUPS)))
def test_every_trainer_side_config_runs_two_tiny_steps(compose_train, tmp_path, group, option):
    tiny = [o for o in TINY_FACE if not (group == "trainer" and o.startswith("trainer="))]
    offline = [o.format(tmp_path=tmp_path) for o in _OFFLINE.get(option, [])] if group == "logger" else []
    if option in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(option)
    cfg = compose_train(f"{group}={option}", *tiny, *offline)
    if _needs_a_gpu(cfg):  # Lightning refuses GPU accelerators and FSDP without CUDA: build what we can
        strategy = cfg.trainer.strategy
        built = instantiate(strategy) if not isinstance(strategy, str) else strategy
        assert built is not None and cfg.trainer.accelerator in {"gpu", "cpu"}
        pytest.skip("this option needs a CUDA device to run; its strategy was built")
    summary = train(cfg)
    assert summary.steps == (1 if cfg.trainer.get("fast_dev_run") else 2)
    assert summary.final_loss is not None and summary.final_loss > 0


@pytest.mark.parametrize(("group", "option"), _all(["sweep", "paths", "experiment"]))
def test_every_other_config_composes(compose_train, group, option):
    assert compose_train(f"{group}={option}").model.backbone


def test_the_slurm_launcher_composes_with_submitit(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"paths.output_dir={tmp_path}", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.tasks_per_node, launcher.gpus_per_node) == ("gpu", 1, 1)
    assert (launcher.signal_delay_s, launcher.max_num_timeout) == (120, 0)
