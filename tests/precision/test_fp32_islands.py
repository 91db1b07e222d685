import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import (
    apply_activation_checkpointing,
    checkpoint_mode,
    remove_activation_checkpointing,
)
from lightning_memopt.models import create_model
from lightning_memopt.precision import apply_fp32_islands, is_fp32_island, remove_fp32_islands
from lightning_memopt.tasks.face_recognition import FaceRecognitionModule


class Recorder(nn.Linear):
    """A linear layer that records the dtype of its input and whether autocast was on."""

    def forward(self, x):
        self.seen = (x.dtype, torch.is_autocast_enabled("cpu"))
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Recorder(8, 4))


def test_an_island_computes_in_fp32_inside_autocast():
    model = _model()
    assert apply_fp32_islands(model, "1") == ["1"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(3, 8))
        assert torch.is_autocast_enabled("cpu")  # restored after the island
    assert model[1].seen == (torch.float32, False)
    assert out.dtype == torch.float32


def test_island_gradients_equal_an_fp32_run_of_the_same_input():
    model = _model()
    apply_fp32_islands(model, [Recorder])
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x)
    hidden.retain_grad()
    model[1](hidden).square().sum().backward()
    island_grad = model[1].weight.grad.clone()
    reference = hidden.detach().float().requires_grad_()
    model[1].weight.grad = None
    remove_fp32_islands(model)
    nn.functional.linear(reference, model[1].weight, model[1].bias).square().sum().backward()
    assert hidden.dtype == torch.bfloat16
    torch.testing.assert_close(island_grad, model[1].weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("islands_first", [True, False])
def test_islands_and_checkpointing_compose_in_either_order(islands_first):
    model, plain = _model(), _model()
    steps = [lambda: apply_fp32_islands(model, "1"), lambda: apply_activation_checkpointing(model, {"modules": "1"})]
    for step in steps if islands_first else steps[::-1]:
        step()
    assert is_fp32_island(model[1]) and checkpoint_mode(model[1]) == "full"
    apply_fp32_islands(plain, "1")
    x = torch.randn(3, 8)
    for net in (model, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(x).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert remove_fp32_islands(model) == 1 and checkpoint_mode(model[1]) == "full"
    assert remove_activation_checkpointing(model) == 1
    assert "forward" not in model[1].__dict__


def test_applying_twice_wraps_once_and_removal_restores_a_user_forward():
    model = _model()
    custom = model[1].forward
    model[1].forward = custom
    apply_fp32_islands(model, "1")
    apply_fp32_islands(model, "1")
    assert remove_fp32_islands(model) == 1
    assert model[1].__dict__["forward"] is custom


def test_preset_islands_are_the_margin_head_and_the_normal_head_output():
    face = FaceRecognitionModule(backbone="iresnet_tiny", num_classes=8)
    assert apply_fp32_islands(face, "preset") == ["head"]
    normals = create_model("sapiens_tiny")
    assert apply_fp32_islands(normals, "preset") == ["head.predict"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert normals.head.predict(torch.randn(1, normals.head.predict.in_channels, 4, 4)).dtype == torch.float32
    assert apply_fp32_islands(create_model("iresnet_tiny"), "preset") == []


def test_a_spec_that_matches_nothing_lists_the_model():
    with pytest.raises(ValueError, match=r"`fp32_modules` entry 'loss' matches no module; module classes present: "):
        apply_fp32_islands(_model(), ["1", "loss"])
