import pytest
import torch

from lightning_memopt.models import create_model, list_models, register_model


def test_every_face_preset_is_registered():
    assert {"r18", "r34", "r50", "r100", "r200", "iresnet_tiny"} <= set(list_models())


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"Unknown model preset `name`='r999'; valid names: .*r100.*r18"):
        create_model("r999")


def test_overrides_reach_the_constructor():
    net = create_model("r18", input_size=32, embedding_size=128)
    assert net.fc.in_features == 512 * 2 * 2 and net.embedding_size == 128


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="'r18' is already registered"):
        register_model("r18")(lambda: torch.nn.Identity())


def test_every_preset_builds_on_the_meta_device_without_allocating():
    for name in list_models():
        with torch.device("meta"):
            net = create_model(name)
        assert {p.device.type for p in net.parameters()} == {"meta"}, name
