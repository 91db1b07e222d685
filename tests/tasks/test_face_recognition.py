import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.tasks import FaceRecognitionModule
from tests.helpers import TINY_FACE, quiet_trainer


def _clustered_faces(num_classes=4, per_class=8, size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(num_classes, 3, size, size, generator=generator) * 2 - 1
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    images = prototypes[labels] + 0.1 * torch.randn(len(labels), 3, size, size, generator=generator)
    return TensorDataset(images.clamp(-1, 1), labels)


def _trainer(tmp_path, **kwargs):
    return quiet_trainer(default_root_dir=tmp_path, **kwargs)


def _module(**kwargs):
    options = dict(num_classes=4, backbone="iresnet_tiny", lr=0.05, scale=16.0, margin_list=(1.0, 0.2, 0.0))
    options.update(kwargs)
    return FaceRecognitionModule(**options)


def _mean_loss(module, data):
    module.eval()
    with torch.no_grad():
        loss = torch.stack([module.loss_and_accuracy(batch)[0] for batch in data]).mean()
    module.train()
    return loss


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_training_lowers_the_loss_on_learnable_identities(tmp_path, optimizer):
    pl.seed_everything(0)
    data = DataLoader(_clustered_faces(), batch_size=16, shuffle=True)
    module = _module(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 2e-3, schedule="constant")
    before = _mean_loss(module, data)
    _trainer(tmp_path, max_epochs=15, gradient_clip_val=5.0).fit(module, data)
    after = _mean_loss(module, data)
    assert after < 0.5 * before


def test_validation_logs_loss_and_accuracy(tmp_path):
    data = DataLoader(_clustered_faces(), batch_size=8)
    trainer = _trainer(tmp_path, max_steps=2, val_check_interval=2, limit_val_batches=2)
    trainer.fit(_module(), data, data)
    assert {"train/loss", "train/acc", "val/loss", "val/acc"} <= set(trainer.callback_metrics)
    assert 0.0 <= float(trainer.callback_metrics["val/acc"]) <= 1.0


def test_scheduler_steps_per_optimizer_step_with_warmup(tmp_path):
    data = DataLoader(_clustered_faces(), batch_size=8)
    module = _module(lr=0.1, warmup_steps=2, schedule="polynomial", power=1.0)
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.fit(module, data)
    # after 4 steps of a 4-step run, the polynomial decay has reached 0
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)
    assert trainer.lr_scheduler_configs[0].interval == "step"


def _fill_gradients(module, value=10.0):
    for p in module.parameters():
        p.grad = torch.full_like(p, value)


def _norm(params):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))


def test_gradient_clipping_touches_only_the_backbone_by_default():
    module = _module()
    _fill_gradients(module)
    module.configure_gradient_clipping(None, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    assert _norm(module.backbone.parameters()) == pytest.approx(1.0, rel=1e-4)
    assert torch.all(module.head.weight.grad == 10.0)


def test_gradient_clipping_of_every_parameter_and_by_value():
    module = _module(clip_backbone_only=False)
    _fill_gradients(module)
    module.configure_gradient_clipping(None, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    assert _norm(module.parameters()) == pytest.approx(1.0, rel=1e-4)
    _fill_gradients(module)
    module.configure_gradient_clipping(None, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    assert all(torch.all(p.grad == 0.5) for p in module.parameters())


@pytest.mark.parametrize("clip_val", [None, 0, 0.0])
def test_zero_or_no_clip_value_leaves_gradients_alone(clip_val):
    module = _module()
    _fill_gradients(module)
    module.configure_gradient_clipping(None, gradient_clip_val=clip_val, gradient_clip_algorithm="norm")
    assert all(torch.all(p.grad == 10.0) for p in module.parameters())


def test_norm_clipping_under_a_sharded_root_uses_its_own_clip_grad_norm():
    calls = []

    class ShardedRoot:  # stands in for an FSDP-wrapped model: the norm must span every shard
        def clip_grad_norm_(self, max_norm):
            calls.append(max_norm)

    class Strategy:
        model = ShardedRoot()

    class FakeTrainer:
        strategy = Strategy()

    module = _module()
    module._trainer = FakeTrainer()
    _fill_gradients(module)
    module.configure_gradient_clipping(None, gradient_clip_val=5.0, gradient_clip_algorithm="norm")
    assert calls == [5.0]
    assert all(torch.all(p.grad == 10.0) for p in module.parameters())


def test_an_endless_run_has_no_schedule_and_says_so(tmp_path):
    data = DataLoader(_clustered_faces(), batch_size=8)
    with pytest.raises(ValueError, match=r"needs a finite run: set `trainer.max_steps` or `trainer.max_epochs`"):
        _trainer(tmp_path, max_steps=-1, max_epochs=-1).fit(_module(), data)


def test_checkpoint_restores_hyperparameters_and_weights(tmp_path):
    data = DataLoader(_clustered_faces(), batch_size=8)
    module = _module(sample_rate=0.5, margin_list=(1.0, 0.0, 0.4))
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(module, data)
    path = tmp_path / "face.ckpt"
    trainer.save_checkpoint(path)
    restored = FaceRecognitionModule.load_from_checkpoint(path)
    assert restored.hparams.sample_rate == 0.5 and restored.head.margin_loss.m3 == 0.4
    for (name, a), (_, b) in zip(module.state_dict().items(), restored.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_mixed_keeps_the_loss_in_fp32(tmp_path):
    module = _module()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module.training_step((torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])), 0)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "lamb"}, r"Unknown `optimizer`='lamb'; valid choices: sgd, adamw"),
        ({"schedule": "step"}, r"Unknown `schedule`='step'; valid choices: polynomial, cosine, constant"),
        ({"optimizer": ["sgd"]}, r"Unknown `optimizer`=\['sgd'\]; valid choices: sgd, adamw"),
        ({"warmup_steps": -5}, r"`warmup_steps` must be an integer ≥ 0, got -5"),
        ({"lr": -0.1}, r"`lr` must be a number > 0, got -0.1"),
        ({"momentum": -0.9}, r"`momentum` must be a number ≥ 0, got -0.9"),
        ({"weight_decay": -1}, r"`weight_decay` must be a number ≥ 0, got -1"),
        ({"betas": [0.9, 1.0]}, r"`betas` must be a number ≥ 0 and < 1, got 1.0"),
        ({"power": 0}, r"`power` must be a number > 0, got 0"),
        ({"scale": -64}, r"`scale` must be a number > 0, got -64"),
        ({"num_classes": 0}, r"`num_classes` must be an integer ≥ 1, got 0"),
        ({"clip_backbone_only": "maybe"}, r"`clip_backbone_only` must be true or false, got 'maybe' \(str\)"),
        ({"hard_sample_weighting": 2}, r"`hard_sample_weighting` must be true or false, got 2 \(int\)"),
        ({"pretrained_weights_only": "perhaps"}, r"`pretrained_weights_only` must be true or false, got 'perhaps'"),
        ({"retrieval_options": {"chunk_size": -1}}, r"`chunk_size` must be an integer ≥ 1, got -1"),
        ({"retrieval_options": {"embeddings_on_cpu": "maybe"}}, r"`embeddings_on_cpu` must be true or false"),
        ({"verification_options": {"far_targets": [2.0]}}, r"`far_targets` must be a number > 0 and ≤ 1, got 2.0"),
    ],
)
def test_bad_optimisation_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": "fast"}, r"`lr` must be a number > 0, got 'fast' \(str\)"),
        ({"warmup_steps": "100"}, r"`warmup_steps` must be an integer ≥ 0, got '100' \(str\)"),
        ({"warmup_steps": True}, r"`warmup_steps` must be an integer ≥ 0, got True \(bool\)"),
        ({"warmup_steps": 2.5}, r"`warmup_steps` must be an integer ≥ 0, got 2.5 \(float\)"),
        ({"num_classes": "ten"}, r"`num_classes` must be an integer ≥ 1, got 'ten' \(str\)"),
        ({"sample_rate": "half"}, r"`sample_rate` must be a number, got 'half' \(str\)"),
        ({"em_iterations": "10"}, r"`em_iterations` must be an integer ≥ 1, got '10' \(str\)"),
        ({"topo_input_size": True}, r"`topo_input_size` must be an integer ≥ 1, got True \(bool\)"),
        ({"betas": 0.9}, r"`betas` must be two numbers in \[0, 1\), e.g. \[0.9, 0.999\], got 0.9"),
        ({"backbone": ["r18"]}, r"`backbone` must be a preset name .*, got \['r18'\] \(list\)"),
        (
            {"backbone_options": "small"},
            r"`backbone_options` must be a mapping of keyword options or None, got 'small'",
        ),
        ({"retrieval_options": {"chunk_size": "big"}}, r"`chunk_size` must be an integer ≥ 1, got 'big' \(str\)"),
        ({"verification_options": {"folds": "ten"}}, r"`folds` must be an integer ≥ 2, got 'ten' \(str\)"),
        ({"verification_options": {"far_targets": "1e-3"}}, r"`far_targets` must be a list of FARs in \(0, 1\]"),
        ({"pretrained": 5}, r"`pretrained` must be a path, got 5 \(int\)"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_at_construction(kwargs, message):
    with pytest.raises(TypeError, match=message):
        _module(**kwargs)


def test_flags_are_read_as_words_not_truth_values():
    module = _module(clip_backbone_only="off", hard_sample_weighting="no", pretrained_weights_only="yes")
    assert module.hparams["clip_backbone_only"] is False and module.hparams["hard_sample_weighting"] is False
    module = _module(clip_backbone_only="on", warmup_steps=10.0, lr=1)
    assert module.hparams["clip_backbone_only"] is True
    assert module.hparams["warmup_steps"] == 10 and isinstance(module.hparams["warmup_steps"], int)
    assert module.hparams["lr"] == 1.0 and isinstance(module.hparams["lr"], float)


def test_the_model_config_reads_words_and_refuses_the_rest(compose_train):
    overrides = ["model.clip_backbone_only=off", "model.retrieval_options.embeddings_on_cpu=on", "model.lr=1"]
    module = instantiate(compose_train(*TINY_FACE, *overrides).model)
    assert module.hparams["clip_backbone_only"] is False and module.val_retrieval.embeddings_on_cpu is True
    with pytest.raises(Exception, match=r"`warmup_steps` must be an integer ≥ 0, got 'abc' \(str\)"):
        instantiate(compose_train(*TINY_FACE, "model.warmup_steps=abc").model)


def test_a_missing_or_folder_pretrained_file_is_named_before_the_model_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint file '/nowhere/a.pth' does not exist \(`pretrained`\)"):
        _module(pretrained="/nowhere/a.pth")
    with pytest.raises(IsADirectoryError, match=r"`pretrained_backbone`: '.*' is a folder, not a file"):
        _module(pretrained_backbone=tmp_path)


def test_validation_logs_retrieval_and_verification_exactly(tmp_path):
    from lightning_memopt.data import SyntheticFaceDataModule
    from lightning_memopt.metrics.functional import retrieval_metrics, tar_at_far, verification_accuracy

    data = SyntheticFaceDataModule(
        num_classes=6, samples_per_class=2, val_samples_per_class=3, image_size=32, batch_size=4,
        verification_pairs=True,
    )  # fmt: skip
    module = _module(num_classes=6)
    trainer = _trainer(tmp_path, max_steps=2, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    module.eval()
    with torch.no_grad():
        images, labels = next(iter(DataLoader(data.val_dataset, batch_size=100)))
        embeddings = module(images)
        first, second, same, _ = next(iter(DataLoader(data.val_dataloader()[1].dataset, batch_size=100)))
        scores = torch.nn.functional.cosine_similarity(module(first), module(second))
    expected = retrieval_metrics(embeddings, labels)
    for name, value in expected.items():
        assert float(metrics[f"val/{name}"]) == pytest.approx(value, abs=1e-6)
    assert float(metrics["val/verification_accuracy"]) == pytest.approx(
        verification_accuracy(scores, same)[0], abs=1e-6
    )
    assert float(metrics["val/verification_tar_at_far_0.001"]) == pytest.approx(
        tar_at_far(scores, same, 1e-3), abs=1e-6
    )
    assert {"val/loss", "val/acc", "val/verification_threshold", "val/verification_tar_at_far_0.0001"} <= set(metrics)


def test_one_validation_sample_per_identity_warns_instead_of_retrieval(tmp_path):
    data = DataLoader(_clustered_faces(per_class=1), batch_size=4)
    trainer = _trainer(tmp_path, max_steps=1, val_check_interval=1, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="no retrieval metrics this epoch: no query has another reference"):
        trainer.fit(_module(), data, data)
    assert "val/precision_at_1" not in trainer.callback_metrics


def test_metric_options_reach_the_validation_metrics():
    module = _module(
        retrieval_options={"embeddings_on_cpu": True, "max_memory": 10**6, "metric": "euclidean"},
        verification_options={"folds": 5, "far_targets": [0.01]},
    )
    retrieval, verification = module.val_retrieval, module.val_verification
    assert (retrieval.embeddings_on_cpu, retrieval.max_memory, retrieval.metric) == (True, 10**6, "euclidean")
    assert (verification.folds, verification.far_targets) == (5, (0.01,))
    with pytest.raises(ValueError, match="Unknown `backend`='annoy'; valid choices: torch, faiss"):
        _module(retrieval_options={"backend": "annoy"})
    with pytest.raises(ValueError, match="`folds` must be an integer ≥ 2, got 1"):
        _module(verification_options={"folds": 1})


def test_topofr_training_step_adds_the_weighted_topological_loss():
    from lightning_memopt.losses import TopologicalAlignmentLoss, hard_sample_probability, prediction_entropy

    images, labels = next(iter(DataLoader(_clustered_faces(), batch_size=12)))
    module = _module(topo_weight=0.1, topo_input_size=8, hard_sample_weighting=True, em_iterations=4)
    loss = module.training_step((images, labels), 0)
    embeddings = module.backbone(images)
    per_sample, cosine, target = module.head(embeddings, labels, reduction="none")
    weights = 1 + hard_sample_probability(prediction_entropy(cosine * 16.0), 4)
    pooled = torch.nn.functional.adaptive_avg_pool2d(images, 8)
    expected = (weights * per_sample).mean() + 0.1 * TopologicalAlignmentLoss()(pooled, embeddings)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in module.backbone.parameters() if p.requires_grad)


def test_topofr_run_logs_both_losses_and_warns_under_micro_batches(tmp_path):
    from lightning_memopt import AdaptiveAccumulation

    data = DataLoader(_clustered_faces(), batch_size=8)
    trainer = _trainer(tmp_path, max_steps=2, callbacks=[AdaptiveAccumulation(micro_batch_size=4)])
    with pytest.warns(UserWarning, match="change the topological alignment loss .spanning trees of the batch."):
        trainer.fit(_module(topo_weight=0.1), data)
    assert {"train/loss", "train/classification_loss", "train/topo_loss"} <= set(trainer.callback_metrics)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topo_weight": -0.1}, r"`topo_weight` must be a number ≥ 0, got -0.1"),
        ({"topo_variant": "bottleneck"}, r"Unknown `topo_variant`='bottleneck'; valid choices: diagram, symmetric"),
        ({"topo_input_size": 0}, r"`topo_input_size` must be an integer ≥ 1, got 0"),
        ({"em_iterations": 0}, r"`em_iterations` must be an integer ≥ 1, got 0"),
    ],
)
def test_bad_topology_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)
