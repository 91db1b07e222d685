"""Every config in conf/ composes with train.yaml, and what it describes can be built."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from lightning_memopt.cli.config import config_dir, instantiate_named
from lightning_memopt.data import pack_image_folder
from tests.helpers import write_face_folder

CONF = Path(config_dir())
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


ALL_OPTIONS = [(group, option) for group in GROUPS for option in _options(group)]


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
    return {
        "image_folder_face": [
            f"data.root={folder}",
            "data.num_classes=2",
            "data.batch_size=2",
            "data.num_workers=0",
            "data.pin_memory=false",
            "data.persistent_workers=false",
        ],
        "memmap_face": [
            f"data.path={tmp_path / 'packed'}",
            "data.num_classes=2",
            "data.batch_size=2",
            "data.num_workers=0",
            "data.pin_memory=false",
            "data.persistent_workers=false",
        ],
    }


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_config_composes_and_instantiates(compose_train, data_overrides, group, option):
    extra = data_overrides.get(option, []) if group == "data" else []
    if group == "data" and option != "synthetic_face":
        extra += ["data.image_size=32"]
    cfg = compose_train(f"{group}={option}", *extra)

    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    images, labels = next(iter(datamodule.train_dataloader()))
    assert images.shape[1:] == (3, cfg.data.image_size, cfg.data.image_size)
    assert int(labels.max()) < datamodule.num_classes == cfg.data.num_classes

    with torch.device("meta"):  # the r200 / 360k-class models are described, not allocated
        model = instantiate(cfg.model)
    assert model.head.num_classes == cfg.data.num_classes

    callbacks = instantiate_named(cfg.memopt.callbacks, "memopt.callbacks")
    loggers = instantiate_named(cfg.logger, "logger")
    if not torch.cuda.is_available() and "FSDP" in str(cfg.trainer.strategy):
        # Lightning's FSDP needs a GPU: on a CPU machine build the strategy alone.
        assert type(instantiate(cfg.trainer.strategy)).__name__ == "FSDPStrategy"
        return
    gpu_only = cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available()
    trainer_kwargs = {"accelerator": "cpu", "devices": 1} if gpu_only else {}
    if gpu_only and cfg.trainer.precision == "16-mixed":
        trainer_kwargs["precision"] = "bf16-mixed"  # what Lightning falls back to on a CPU anyway
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **trainer_kwargs)
    assert trainer.fast_dev_run or trainer.max_steps == cfg.trainer.max_steps
