"""The default policy on models that declare nothing: the discovered blocks, bitwise-equal training, less memory."""

import copy

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.callbacks import activation_checkpointing as callback_module
from lightning_memopt.checkpointing import apply_activation_checkpointing, checkpoint_mode
from lightning_memopt.memory import profile_step
from tests.foreign_models import StagedCNN, TinyViT, TwoTower, classification_loss, image_batch
from tests.helpers import quiet_trainer


def _two_tower_loss(model, batch):
    images, _ = batch
    return -model(images[:, :, :8, :8], images[:, 0, 0, :16])


# model, loss, blocks discovered, blocks kept by every_n (√L of each run of L siblings)
MODELS = {
    "TinyViT": (TinyViT, classification_loss, 4, 2),
    "StagedCNN": (StagedCNN, classification_loss, 7, 6),
    "TwoTower": (TwoTower, _two_tower_loss, 5, 4),
}


def _train(model: nn.Module, loss_fn, steps: int = 2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, image_batch(8, seed=step)).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return grads, model.state_dict()


# "lean" on blocks without a lean path of their own is plain full recomputation
@pytest.mark.parametrize("policy", ["auto", "selective", "offload", "every_n", "lean"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_discovered_blocks_train_with_bitwise_equal_gradients_and_buffers(name, policy):
    build, loss_fn, blocks, thinned = MODELS[name]
    torch.manual_seed(0)
    reference = build()
    checkpointed = copy.deepcopy(reference)
    assert apply_activation_checkpointing(checkpointed, policy) == (thinned if policy == "every_n" else blocks)
    expected_grads, expected_state = _train(reference, loss_fn)
    grads, state = _train(checkpointed, loss_fn)
    for expected, got in zip(expected_grads, grads, strict=True):
        assert all(torch.equal(expected[key], got[key]) for key in expected)
    assert all(torch.equal(expected_state[key], state[key]) for key in expected_state)  # batch-norm statistics too


@pytest.mark.parametrize("name", ["TinyViT", "StagedCNN"])
def test_checkpointing_the_discovered_blocks_lowers_the_activation_peak(name):
    build, loss_fn, _, _ = MODELS[name]
    batch = image_batch(16)

    def peak(policy):
        torch.manual_seed(0)
        model = build()
        if policy is not None:
            apply_activation_checkpointing(model, policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return profile_step(model, batch, loss_fn=loss_fn, optimizer=optimizer).breakdown["activations"]

    assert peak("auto") < 0.6 * peak(None)


class ForeignTask(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyViT()

    def training_step(self, batch, batch_idx):
        return classification_loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_callback_with_its_defaults_checkpoints_a_foreign_lightning_module(tmp_path, monkeypatch):
    messages = []
    monkeypatch.setattr(callback_module, "rank_zero_info", messages.append)
    module = ForeignTask()
    seen = []

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([checkpoint_mode(layer) for layer in pl_module.net.encoder.layers])

    callback = ActivationCheckpointing()
    loader = torch.utils.data.DataLoader(list(zip(*image_batch(8), strict=True)), batch_size=4)
    trainer = quiet_trainer(max_steps=2, callbacks=[callback, Spy()], default_root_dir=tmp_path)
    trainer.fit(module, loader)
    assert seen == [["full"] * 4] * 2
    assert messages == ["ActivationCheckpointing: wrapped 4 modules: full 4 (EncoderLayer ×4); blocks discovered"]
    assert all(checkpoint_mode(layer) is None for layer in module.net.encoder.layers)  # undone at teardown


def test_a_transformers_model_is_checkpointed_with_the_defaults():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    config.num_labels = 10
    reference = transformers.ViTForImageClassification(config).train()
    checkpointed = copy.deepcopy(reference)
    assert apply_activation_checkpointing(checkpointed) == 3
    assert [checkpoint_mode(layer) for layer in checkpointed.vit.layers] == ["full"] * 3

    def loss_fn(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)

    expected, _ = _train(reference, loss_fn)
    got, _ = _train(checkpointed, loss_fn)
    for a, b in zip(expected, got, strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)
