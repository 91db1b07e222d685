"""Every config in conf/ composes with train.yaml, and what it describes can be built or run."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.train import train
from lightning_memopt.data import pack_image_folder
from tests.helpers import TINY_FACE, write_face_folder

CONF = Path(config_dir())
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
RUNNABLE_GROUPS = {"precision", "strategy", "trainer", "logger", "memopt", "debug"}


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


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
    """Per data option, the overrides that point it at small real files."""
    folder = tmp_path / "faces"
    write_face_folder(folder, {"alice": 2, "bob": 2}, size=(32, 32))
    pack_image_folder(folder, tmp_path / "packed")
    loader = [
        "data.num_classes=2",
        "data.batch_size=2",
        "data.image_size=32",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.persistent_workers=false",
    ]
    return {
        "synthetic_face": [],
        "image_folder_face": [f"data.root={folder}", *loader],
        "memmap_face": [f"data.path={tmp_path / 'packed'}", *loader],
    }


@pytest.mark.parametrize(("group", "option"), _all(["data"]))
def test_every_data_config_gives_face_batches(compose_train, data_overrides, group, option):
    cfg = compose_train(f"data={option}", *data_overrides[option])
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    images, labels = next(iter(datamodule.train_dataloader()))
    assert images.shape[1:] == (3, cfg.data.image_size, cfg.data.image_size)
    assert int(labels.max()) < datamodule.num_classes == cfg.data.num_classes


@pytest.mark.parametrize(("group", "option"), _all(["model"]))
def test_every_model_config_builds_its_module(compose_train, group, option):
    cfg = compose_train(f"model={option}")
    with torch.device("meta"):  # the r200 model is described, not allocated
        model = instantiate(cfg.model)
    assert model.hparams.backbone == option and model.head.num_classes == cfg.data.num_classes


def _needs_a_gpu(cfg):
    return not torch.cuda.is_available() and (cfg.trainer.accelerator == "gpu" or "FSDP" in str(cfg.trainer.strategy))


@pytest.mark.parametrize(("group", "option"), _all(sorted(RUNNABLE_GROUPS)))
def test_every_trainer_side_config_runs_two_tiny_steps(compose_train, group, option):
    tiny = [o for o in TINY_FACE if not (group == "trainer" and o.startswith("trainer="))]
    cfg = compose_train(f"{group}={option}", *tiny)
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
