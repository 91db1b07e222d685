"""memopt-export writes a trained network in its official layout; memopt-train starts from official files."""

import pytest
import torch

from lightning_memopt.cli.export import export_official, main
from lightning_memopt.cli.train import train
from lightning_memopt.models import create_model
from tests.helpers import REPO_ROOT, TINY_FACE, run_python


def _official_file(tmp_path, seed=0):
    generator = torch.Generator().manual_seed(seed)
    official = {
        key: torch.randn(value.shape, generator=generator) if value.is_floating_point() else value
        for key, value in create_model("iresnet_tiny").state_dict().items()
    }
    path = tmp_path / "official.pth"
    torch.save({"state_dict": {"module." + key: value for key, value in official.items()}}, path)
    return path, official


def test_train_starts_from_an_official_file_and_exports_back(compose_train, tmp_path, capsys):
    path, official = _official_file(tmp_path)
    train(compose_train(*TINY_FACE, f"model.pretrained='{path}'"))
    checkpoint = next(tmp_path.glob("csv/version_*/checkpoints/*.ckpt"))
    capsys.readouterr()
    main([str(checkpoint), str(tmp_path / "exported.pth")])
    assert "tensors in the official IResNet layout" in capsys.readouterr().out
    exported = torch.load(tmp_path / "exported.pth", weights_only=True)
    trained = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert list(exported) == list(official)
    assert all(torch.equal(exported[key], trained["backbone." + key]) for key in official)
    # the run started from the official weights: two optimiser steps moved them, but only a little
    assert not torch.equal(exported["fc.weight"], official["fc.weight"])
    assert torch.allclose(exported["fc.weight"], official["fc.weight"], atol=0.5)


@pytest.mark.slow
def test_export_of_a_bare_state_dict_needs_the_preset(tmp_path):
    ours = create_model("iresnet_tiny").state_dict()
    official, family = export_official(ours, "iresnet_tiny")
    assert family == "IResNet" and all(torch.equal(official[key], value) for key, value in ours.items())
    torch.save(ours, tmp_path / "ours.pth")
    result = run_python(["-m", "lightning_memopt.cli.export", str(tmp_path / "ours.pth"), "out.pth"], tmp_path, 120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "memopt-export: the checkpoint does not name its preset" in result.stderr and "--model NAME" in result.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.pretrained=/nowhere/a.pth", "memopt-train: checkpoint file '/nowhere/a.pth' does not exist"),
        pytest.param(
            "model.pretrained_backbone=PATH",
            "memopt-train: `backbone_only`=True, but IResNet checkpoints come whole",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "model.optimizer=lamb",
            "memopt-train: Unknown `model.optimizer`='lamb'; valid choices: sgd, adamw",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_memopt_train_ends_a_bad_pretrained_file_or_option_with_its_reason(tmp_path, override, message):
    path, _ = _official_file(tmp_path)
    override = override.replace("PATH", str(path))
    result = run_python(["-m", "lightning_memopt.train", *TINY_FACE, override], tmp_path, 300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert REPO_ROOT.exists()


def test_export_reads_networks_saved_under_checkpointing_and_compile_wrappers():
    network = create_model("cotracker3_tiny")
    wrapped = {
        "backbone."
        + key.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module.").replace("fnet.", "_orig_mod.fnet."): value
        for key, value in network.state_dict().items()
    }
    assert any("_checkpoint_wrapped_module" in key for key in wrapped)
    checkpoint = {"state_dict": wrapped, "hyper_parameters": {"backbone": "cotracker3_tiny", "backbone_options": {}}}
    official, family = export_official(checkpoint)
    assert family == "CoTracker3" and "updateformer.vis_conf_head.weight" in official
    assert torch.equal(official["fnet.conv1.weight"], network.fnet.stem[0].weight)
