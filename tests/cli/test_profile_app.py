import pytest
from hydra import compose, initialize_config_dir

from lightning_memopt.cli.config import config_dir
from lightning_memopt.cli.profile import main, profile, write_breakdown_chart
from tests.helpers import REPO_ROOT, TINY_FACE, TINY_NORMALS


def _compose(*overrides):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("profile", overrides=list(overrides))


def test_profile_config_shares_the_training_tree():
    cfg = _compose("model=r50", "precision=bf16_mixed")
    assert cfg.model.backbone == "r50" and cfg.trainer.precision == "bf16-mixed"
    assert cfg.profile.mode == "fake" and cfg.profile.round_to == 512


@pytest.mark.parametrize(
    "overrides", [TINY_FACE, ["experiment=sapiens_2b_normal", *TINY_NORMALS]], ids=["face", "normals"]
)
def test_fake_and_real_profiles_of_a_composed_config_agree(overrides):
    fake = profile(_compose(*overrides, "profile.round_to=1", "profile.device_type=cpu"))
    real = profile(_compose(*overrides, "profile.round_to=1", "profile.mode=real"))
    assert fake.mode == "fake" and real.mode == "real-cpu"
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.03 * real.peak_bytes


def test_a_prediction_for_cuda_counts_the_library_workspaces_of_the_gpu_named():
    from lightning_memopt.planner import gpu

    cpu = profile(_compose(*TINY_FACE, "profile.device_type=cpu"))
    hopper = profile(_compose(*TINY_FACE))  # the default: cuda, h100_80gb
    ampere = profile(_compose(*TINY_FACE, "profile.gpu=a100_80gb"))
    # two cuBLAS handles (the forward's thread, autograd's) at least; a convolution's cuDNN workspace on top
    assert hopper.peak_bytes - cpu.peak_bytes >= 2 * gpu("h100_80gb").workspace.cublas_bytes
    assert 2 * gpu("a100_80gb").workspace.cublas_bytes <= ampere.peak_bytes - cpu.peak_bytes
    assert ampere.peak_bytes < hopper.peak_bytes
    with pytest.raises(ValueError, match=r"Unknown `profile.device_type`='tpu'; valid choices: cpu, cuda"):
        profile(_compose(*TINY_FACE, "profile.device_type=tpu"))
    with pytest.raises(ValueError, match=r"Unknown `profile.gpu`='a6000'; valid names: v100_16gb"):
        profile(_compose(*TINY_FACE, "profile.gpu=a6000"))


def test_the_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    write_breakdown_chart(profile(_compose(*TINY_FACE)), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_console_script_is_declared():
    assert "memopt-profile = lightning_memopt.cli.profile:main" in (REPO_ROOT / "setup.cfg").read_text()
    assert callable(main)
