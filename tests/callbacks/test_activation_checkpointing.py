import re

import lightning.pytorch as pl
import pytest
import torch
from helpers import TINY_FACE, quiet_trainer, run_memopt_train
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.callbacks import activation_checkpointing as callback_module
from lightning_memopt.checkpointing import checkpoint_mode
from lightning_memopt.models import create_model
from lightning_memopt.models.vit import ViTBlock


class TinyViTModule(pl.LightningModule):
    """Sapiens tiny regressing its own input's mean; the network is built in ``__init__`` or ``configure_model``."""

    def __init__(self, build_in_configure_model=False):
        super().__init__()
        torch.manual_seed(0)
        self.build_in_configure_model = build_in_configure_model
        self.network = None if build_in_configure_model else create_model("sapiens_tiny", drop_path_rate=0.2)
        self.modes_seen = []

    def configure_model(self):
        if self.network is None:
            self.network = create_model("sapiens_tiny", drop_path_rate=0.2)

    def training_step(self, batch, batch_idx):
        self.modes_seen.append([checkpoint_mode(block) for block in self.network.backbone.blocks])
        return self.network(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader():
    return DataLoader(TensorDataset(torch.randn(4, 3, 64, 48)), batch_size=2)


def _fit(module, callback, steps=2):
    torch.manual_seed(0)
    quiet_trainer(max_steps=steps, callbacks=[callback] if callback else []).fit(module, _loader())
    return module


def test_fit_checkpoints_during_training_gives_the_same_weights_and_restores_the_model(monkeypatch):
    messages = []
    monkeypatch.setattr(callback_module, "rank_zero_info", messages.append)
    reference = _fit(TinyViTModule(), None)
    callback = ActivationCheckpointing("preset")
    checkpointed = _fit(TinyViTModule(), callback)
    assert checkpointed.modes_seen == [["full", "full"]] * 2
    assert callback.report.count == 6
    assert messages == [
        "ActivationCheckpointing: wrapped 6 modules: full 6 (ConvNormAct ×3, ViTBlock ×2, ConvNormActChain ×1); "
        "blocks declared"
    ]
    assert all(checkpoint_mode(m) is None for m in checkpointed.modules())  # removed in teardown
    for (name, expected), got in zip(reference.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.equal(got, expected), name


def test_layers_built_in_configure_model_are_checkpointed_before_the_strategy_wraps():
    module = _fit(TinyViTModule(build_in_configure_model=True), ActivationCheckpointing({"modules": ViTBlock}))
    assert module.modes_seen[0] == ["full", "full"]
    assert "configure_model" not in vars(module)  # the hook is the class's own again


def test_composed_policy_from_the_callback():
    module = _fit(TinyViTModule(), ActivationCheckpointing([{"modules": ViTBlock, "every_n": 2}, "offload"]))
    assert module.modes_seen[0] == ["full", "offload"]


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"mode": "fast"}, r"Unknown `mode`='fast'; valid choices: full, selective"),
        ({"every_n": "two"}, r"`every_n` must be an integer ≥ 1, 'sqrt' or None, got 'two' \(str\)"),
        ({"every_n": -1}, r"`every_n` must be an integer ≥ 1, 'sqrt' or None, got -1 \(int\)"),
        ({"every_n": True}, r"`every_n` must be an integer ≥ 1, 'sqrt' or None, got True \(bool\)"),
        ({"modules": 3}, r"`modules` must be module classes, dotted class paths or name globs, got 3 \(int\)"),
        (3, r"`policy`=3 must be a Policy, a string"),
    ],
)
def test_bad_policy_is_refused_when_the_callback_is_made(policy, message):
    shown = re.escape(repr(policy))  # the whole policy, then what is wrong in it
    with pytest.raises(MisconfigurationException, match=f"^ActivationCheckpointing: bad `policy`={shown}: {message}"):
        ActivationCheckpointing(policy)


def test_a_policy_matching_nothing_fails_the_fit_listing_what_is_there():
    with pytest.raises(MisconfigurationException, match="matches no module; module classes present: .*ViTBlock"):
        _fit(TinyViTModule(), ActivationCheckpointing("decoder.*"))


def test_under_fsdp_with_its_own_policy_the_callback_stands_aside():
    strategy = FSDPStrategy(activation_checkpointing_policy={ViTBlock})
    trainer = type("FakeTrainer", (), {"strategy": strategy})()
    module = TinyViTModule()
    callback = ActivationCheckpointing("preset")
    callback.setup(trainer, module, "fit")
    assert callback.report is None
    assert all(checkpoint_mode(m) is None for m in module.modules())
    callback.setup(type("FakeTrainer", (), {"strategy": FSDPStrategy()})(), module, "fit")
    module.configure_model()  # as Lightning calls it, before FSDP wraps the model
    assert callback.report.count == 6  # without a policy of its own, FSDP gets ours (6 blocks)


def test_the_hydra_bundle_composes(compose_train):
    cfg = compose_train("memopt=checkpointing")
    assert cfg.memopt.callbacks.activation_checkpointing.policy == "auto"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_on_two_cpu_processes_trains_with_checkpointing(tmp_path):
    args = [*TINY_FACE, "strategy=ddp", "trainer.devices=2", "data.batch_size=4", "memopt=checkpointing"]
    result = run_memopt_train(args, cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "ActivationCheckpointing: wrapped 4 modules: full 4 (IBasicBlock ×4)" in output
    assert "ready twice" not in output and "ready only once" not in output


def test_non_module_spec_is_refused():
    with pytest.raises(MisconfigurationException, match="is not an nn.Module subclass"):
        ActivationCheckpointing({"modules": [dict]})
    assert isinstance(ActivationCheckpointing(nn.Linear).policies[0].modules[0], type)


def test_after_configure_model_refuses_what_it_cannot_run():
    from lightning_memopt.callbacks.module_hooks import after_configure_model

    with pytest.raises(TypeError, match=r"`pl_module` must be a LightningModule, got Linear"):
        after_configure_model(nn.Linear(2, 2), lambda: None)
    with pytest.raises(TypeError, match=r"`action` must be a function of no arguments, got 'wrap' \(str\)"):
        after_configure_model(TinyViTModule(), "wrap")
