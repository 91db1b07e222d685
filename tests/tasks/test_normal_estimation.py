import math
from types import SimpleNamespace

import lightning
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.data import DataLoader

from lightning_memopt.cli.export import export_official
from lightning_memopt.cli.train import train
from lightning_memopt.data.synthetic_normals import SyntheticNormalsDataset
from lightning_memopt.models import create_model, to_official_state_dict
from lightning_memopt.tasks import NormalEstimationModule
from lightning_memopt.tasks.common import layer_decay_param_groups
from lightning_memopt.tasks.normals import AngularError, angular_error_degrees, normal_loss, resize_normals
from tests.helpers import TINY_NORMALS, quiet_trainer

VAL_KEYS = {"val/loss", "val/mean_angle", "val/median_angle", "val/within_11.25", "val/within_22.5", "val/within_30"}


def _field(*vectors):
    """A [1, 3, 1, N] normal map holding the given 3-vectors."""
    return torch.tensor(vectors, dtype=torch.float32).T.reshape(1, 3, 1, len(vectors))


def _all_valid(normals):
    return torch.ones(normals.shape[0], 1, *normals.shape[2:], dtype=torch.bool)


def _module(**kwargs):
    options = dict(backbone="sapiens_tiny", lr=2e-3, warmup_steps=0, schedule="constant")
    options.update(kwargs)
    return NormalEstimationModule(**options)


def _loader(num_samples=8, batch_size=4, first_index=0):
    dataset = SyntheticNormalsDataset(num_samples, (64, 48), seed=0, first_index=first_index)
    return DataLoader(dataset, batch_size=batch_size)


def test_loss_is_one_minus_cosine_plus_l1_of_the_unit_vectors():
    prediction = _field((1, 0, 0), (0, 0, 1), (0, 0, 1))
    target = _field((1, 0, 0), (1, 0, 0), (0, 0, -1))
    total, cosine, l1 = normal_loss(prediction, target, _all_valid(target))
    # per pixel: cosine terms 0, 1, 2 and L1 terms 0, 2/3, 2/3
    assert cosine.item() == pytest.approx(1.0)
    assert l1.item() == pytest.approx(4 / 9)
    assert total.item() == pytest.approx(1 + 4 / 9)
    weighted, _, _ = normal_loss(prediction, target, _all_valid(target), cosine_weight=2.0, l1_weight=0.5)
    assert weighted.item() == pytest.approx(2.0 + 2 / 9)


def test_loss_ignores_invalid_pixels_even_when_their_target_is_nan():
    prediction = _field((0, 0, 1), (0, 0, 1)).requires_grad_()
    target = _field((0, 0, 1), (float("nan"), 0, 0))
    mask = torch.tensor([[[[True, False]]]])
    total, _, _ = normal_loss(prediction, target, mask)
    total.backward()
    assert total.item() == 0.0 and torch.isfinite(prediction.grad).all()
    empty, _, _ = normal_loss(prediction, target, torch.zeros_like(mask))
    assert empty.item() == 0.0


def test_predictions_are_upsampled_bilinearly_to_the_label_size_then_normalised():
    prediction = 3.0 * torch.randn(2, 3, 4, 3)  # raw, like the head's output
    resized = resize_normals(prediction, (8, 6))
    expected = F.normalize(F.interpolate(prediction, size=(8, 6), mode="bilinear", align_corners=False), dim=1)
    torch.testing.assert_close(resized, expected)
    torch.testing.assert_close(resized.norm(dim=1), torch.ones(2, 8, 6))


def test_forward_and_the_loss_normalise_the_raw_network_output():
    torch.manual_seed(0)
    module = _module().eval()
    images = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        raw = module.network(images)
        normals = module(images)
        prediction, _, _, _ = module.loss_terms(
            {"image": images, "normal": F.normalize(torch.randn(2, 3, 64, 48), dim=1), "mask": _all_valid(images)}
        )
    assert not torch.allclose(raw.norm(dim=1), torch.ones(2, 32, 24))
    torch.testing.assert_close(normals, F.normalize(raw, dim=1))
    torch.testing.assert_close(prediction, resize_normals(raw, (64, 48)))
    torch.testing.assert_close(prediction.norm(dim=1), torch.ones(2, 64, 48))


def test_angular_error_in_degrees():
    prediction = _field((0, 0, 1), (0, 0, 1), (0, 0, 1), (0, 0, 1), (0, 0, 1))
    small = math.radians(0.01)
    target = _field((0, 0, 1), (0, 1, 1), (1, 0, 0), (0, 0, -1), (math.sin(small), 0, math.cos(small)))
    target = F.normalize(target, dim=1)
    angles = angular_error_degrees(prediction, target).flatten()
    torch.testing.assert_close(angles, torch.tensor([0.0, 45.0, 90.0, 180.0, 0.01]), rtol=1e-4, atol=1e-5)


def test_angular_error_metric_matches_direct_statistics_over_several_batches():
    torch.manual_seed(0)
    metric = AngularError()
    all_angles = []
    for _ in range(3):
        prediction = F.normalize(torch.randn(2, 3, 5, 7), dim=1)
        target = F.normalize(prediction + 0.5 * torch.randn(2, 3, 5, 7), dim=1)
        mask = torch.rand(2, 1, 5, 7) > 0.3
        metric.update(prediction, target, mask)
        all_angles.append(angular_error_degrees(prediction, target)[mask[:, 0]])
    angles = torch.cat(all_angles)
    values = metric.compute()
    assert values["mean_angle"].item() == pytest.approx(angles.mean().item(), rel=1e-5)
    assert abs(values["median_angle"].item() - angles.median().item()) <= 0.005 + 1e-6
    for threshold in (11.25, 22.5, 30):
        expected = 100.0 * (angles < threshold).float().mean().item()
        assert values[f"within_{threshold:g}"].item() == pytest.approx(expected)


def test_angular_error_states_merge_like_ranks_of_a_distributed_run():
    torch.manual_seed(1)
    prediction = F.normalize(torch.randn(4, 3, 6, 6), dim=1)
    target = F.normalize(torch.randn(4, 3, 6, 6), dim=1)
    mask = _all_valid(target)
    whole, rank0, rank1 = AngularError(), AngularError(), AngularError()
    whole.update(prediction, target, mask)
    rank0.update(prediction[:2], target[:2], mask[:2])
    rank1.update(prediction[2:], target[2:], mask[2:])
    rank0.merge_state(rank1)
    for key, value in whole.compute().items():
        torch.testing.assert_close(rank0.compute()[key], value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bin_width": 0}, ValueError, r"`bin_width` must be a number > 0 and ≤ 180, got 0"),
        ({"bin_width": "fine"}, TypeError, r"`bin_width` must be a number > 0 and ≤ 180, got 'fine' \(str\)"),
        ({"thresholds": [11.25, -1]}, ValueError, r"`thresholds` must be a number > 0, got -1"),
        ({"thresholds": "11.25"}, TypeError, r"`thresholds` must be a non-empty list of angles in degrees"),
        ({"thresholds": []}, TypeError, r"`thresholds` must be a non-empty list of angles in degrees, got \[\]"),
    ],
)
def test_angular_error_refuses_bad_bins(kwargs, error, message):
    with pytest.raises(error, match=message):
        AngularError(**kwargs)


def _group_of(groups):
    return {id(p): group for group in groups for p in group["params"]}


def test_layer_wise_lr_decay_and_no_weight_decay_on_biases_norms_and_position_table():
    network = create_model("sapiens_tiny", depth=3)
    groups = layer_decay_param_groups(network, lr=1.0, weight_decay=0.1, layer_decay=0.85)
    group_of = _group_of(groups)
    named = dict(network.named_parameters())
    assert len(group_of) == len(named)  # every parameter exactly once

    def lr(name):
        return group_of[id(named[name])]["lr"]

    def decay(name):
        return group_of[id(named[name])]["weight_decay"]

    assert lr("backbone.pos_embed") == lr("backbone.patch_embed.weight") == pytest.approx(0.85**4)
    assert [lr(f"backbone.blocks.{i}.attn.qkv.weight") for i in range(3)] == pytest.approx([0.85**3, 0.85**2, 0.85])
    assert lr("backbone.norm.weight") == lr("head.predict.weight") == 1.0
    assert decay("backbone.blocks.0.ffn.0.weight") == decay("head.upsample.0.0.weight") == 0.1
    no_decay = ["backbone.pos_embed", "backbone.blocks.0.attn.qkv.bias", "backbone.blocks.1.norm1.weight"]
    assert [decay(name) for name in no_decay + ["backbone.norm.bias", "head.predict.bias"]] == [0.0] * 5


def test_layer_groups_see_through_checkpoint_wrappers():
    network = create_model("sapiens_tiny")
    expected = [(g["name"], g["lr"], len(g["params"])) for g in layer_decay_param_groups(network, 1.0, 0.1, 0.85)]
    for index, block in enumerate(network.backbone.blocks):
        network.backbone.blocks[index] = checkpoint_wrapper(block)
    groups = layer_decay_param_groups(network, 1.0, 0.1, 0.85)
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == expected


def test_one_optimisation_step_on_the_cpu_updates_the_network(tmp_path):
    module = _module()
    before = [p.detach().clone() for p in module.network.parameters()]
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, gradient_clip_val=1.0)
    trainer.fit(module, _loader(num_samples=2, batch_size=2))
    assert trainer.global_step == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, module.network.parameters(), strict=True))
    assert float(trainer.callback_metrics["train/loss"]) > 0


def test_loss_decreases_over_a_few_steps_on_synthetic_normals(tmp_path):
    pl.seed_everything(0)
    data = _loader(num_samples=4, batch_size=2)
    module = _module(lr=3e-3)

    def mean_loss():
        module.eval()
        with torch.no_grad():
            loss = torch.stack([module.loss_terms(batch)[1] for batch in data]).mean()
        module.train()
        return loss.item()

    before = mean_loss()
    quiet_trainer(default_root_dir=tmp_path, max_steps=8, gradient_clip_val=1.0).fit(module, data)
    assert mean_loss() < 0.5 * before


def test_validation_logs_the_loss_and_the_angular_errors(tmp_path):
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=2)
    trainer.fit(_module(), _loader(num_samples=2, batch_size=2), _loader(4, batch_size=2, first_index=100))
    metrics = trainer.callback_metrics
    assert set(metrics) >= VAL_KEYS
    assert 0 <= float(metrics["val/median_angle"]) <= 180
    assert float(metrics["val/within_11.25"]) <= float(metrics["val/within_22.5"]) <= float(metrics["val/within_30"])


def test_warmup_then_polynomial_decay_keeps_the_layer_ratios(tmp_path):
    module = _module(lr=1e-3, warmup_steps=2, schedule="polynomial", power=1.0, layer_decay=0.5)
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=4)
    trainer.fit(module, _loader(num_samples=8, batch_size=2))
    scheduler = trainer.lr_scheduler_configs[0]
    assert scheduler.interval == "step"
    lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
    # 4 steps: warm-up over steps 0-1, then (1 - 2/2)^1 = 0 at step 4
    assert lrs["layer_3_decay"] == pytest.approx(0.0)
    assert [round(factor, 3) for factor in (scheduler.scheduler.lr_lambdas[0](s) for s in range(5))] == [
        0.5,
        1.0,
        1.0,
        0.5,
        0.0,
    ]
    assert scheduler.scheduler.base_lrs[0] == pytest.approx(1e-3 * 0.5**3)  # layer 0 of a 2-block network


def test_norm_clipping_goes_through_the_sharded_root_under_fsdp():
    calls = []
    module = _module()
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(model=SimpleNamespace(clip_grad_norm_=calls.append)))
    module.configure_gradient_clipping(None, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    assert calls == [1.0]


def test_checkpoint_reloads_the_same_network(tmp_path):
    module = _module()
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1)
    trainer.fit(module, _loader(num_samples=2, batch_size=2))
    trainer.save_checkpoint(tmp_path / "normals.ckpt")
    reloaded = NormalEstimationModule.load_from_checkpoint(tmp_path / "normals.ckpt")
    images = torch.randn(1, 3, 64, 48)
    torch.testing.assert_close(reloaded.eval()(images), module.eval()(images))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backbone": "iresnet_tiny"}, r"`backbone`='iresnet_tiny' is not a normal-estimation network"),
        ({"layer_decay": 0.0}, r"`layer_decay` must be a number > 0 and ≤ 1, got 0.0"),
        ({"layer_decay": 1.5}, r"`layer_decay` must be a number > 0 and ≤ 1, got 1.5"),
        ({"lr": 0.0}, r"`lr` must be a number > 0, got 0.0"),
        ({"cosine_weight": 0.0, "l1_weight": 0.0}, r"`cosine_weight` and `l1_weight` are both 0"),
        ({"l1_weight": -1.0}, r"`l1_weight` must be a number ≥ 0, got -1.0"),
        ({"warmup_steps": -1}, r"`warmup_steps` must be an integer ≥ 0, got -1"),
        ({"schedule": "step"}, r"Unknown `schedule`='step'; valid choices: polynomial, cosine, constant"),
        ({"pretrained_weights_only": "maybe"}, r"`pretrained_weights_only` must be true or false, got 'maybe'"),
        ({"backbone_options": {"attn_impl": "flash"}}, r"Unknown `attn_impl`='flash'; valid choices: sdpa, math"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": "abc"}, r"`lr` must be a number > 0, got 'abc' \(str\)"),
        ({"warmup_steps": "400"}, r"`warmup_steps` must be an integer ≥ 0, got '400' \(str\)"),
        ({"warmup_steps": False}, r"`warmup_steps` must be an integer ≥ 0, got False \(bool\)"),
        ({"layer_decay": None}, r"`layer_decay` must be a number > 0 and ≤ 1, got None \(NoneType\)"),
        ({"betas": "0.9,0.999"}, r"`betas` must be two numbers in \[0, 1\)"),
        ({"backbone_options": ["patch_size", 16]}, r"`backbone_options` must be a mapping of keyword options"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        _module(**kwargs)


def test_the_experiment_holds_the_published_recipe(compose_train):
    cfg = compose_train("experiment=sapiens_2b_normal")
    model, data, trainer = cfg.model, cfg.data, cfg.trainer
    assert model.backbone == "sapiens_2b" and model.backbone_options.drop_path_rate == 0.0
    assert (model.lr, list(model.betas), model.weight_decay, model.layer_decay) == (5e-4, [0.9, 0.999], 0.1, 0.85)
    assert (model.warmup_steps, model.schedule, model.power) == (400, "polynomial", 1.0)
    assert (list(data.image_size), data.batch_size) == ([1024, 768], 1)
    assert (trainer.gradient_clip_val, trainer.precision, trainer.accelerator) == (1.0, "32-true", "gpu")


@pytest.mark.parametrize("preset", ["sapiens_0.3b", "sapiens_0.6b", "sapiens_1b", "sapiens_2b", "sapiens_tiny"])
def test_every_sapiens_model_config_builds_its_module_on_the_meta_device(compose_train, preset):
    cfg = compose_train(f"model={preset}", "data=synthetic_normals")
    with torch.device("meta"):
        module = instantiate(cfg.model)
    assert module.hparams.backbone == preset and module.network.backbone.patch_size == 16


def test_the_experiment_logs_every_angular_metric(compose_train, tmp_path):
    train(compose_train("experiment=sapiens_2b_normal", *TINY_NORMALS))
    header = next(tmp_path.glob("csv/version_*/metrics.csv")).read_text().splitlines()[0]
    assert VAL_KEYS | {"train/loss"} <= set(header.split(","))


def test_a_checkpoint_of_a_run_started_from_an_official_file_loads_without_that_file(tmp_path):
    official = to_official_state_dict(create_model("sapiens_tiny").state_dict(), "sapiens_tiny")
    torch.save({"state_dict": official}, tmp_path / "official.pth")
    module = NormalEstimationModule(backbone="sapiens_tiny", pretrained=str(tmp_path / "official.pth"))
    assert module.network.backbone.position_grid == (4, 3)  # the file's token grid, adopted
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    torch.save(checkpoint, tmp_path / "run.ckpt")
    (tmp_path / "official.pth").unlink()
    assert "pretrained" not in checkpoint["hyper_parameters"]
    restored = NormalEstimationModule.load_from_checkpoint(tmp_path / "run.ckpt")
    assert restored.network.backbone.position_grid == (4, 3)
    assert torch.equal(restored.network.backbone.pos_embed, module.network.backbone.pos_embed)
    exported, family = export_official(checkpoint)
    assert family == "Sapiens" and all(torch.equal(exported[key], value) for key, value in official.items())
