import functools
import math

import pytest
import torch
from hydra.utils import instantiate

from lightning_memopt.data import SyntheticTrackingDataModule
from lightning_memopt.models import TrackerOutput
from lightning_memopt.tasks import TrackingModule
from lightning_memopt.tasks.tracking_losses import tracking_losses, tracking_metrics, window_targets
from tests.helpers import quiet_trainer


@pytest.fixture(autouse=True)
def _one_thread(request):
    """The tiny trackers' kernels are so small that a second thread only adds overhead (5× under load)."""
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(1)


def _datamodule(**kwargs):
    options = dict(num_clips=2, val_clips=1, sequence_len=8, image_size=(64, 64), traj_per_sample=16, batch_size=2)
    options.update(kwargs)
    return SyntheticTrackingDataModule(**options)


def _output(window_tracks, window_visibility, window_confidence=None, starts=(0,), num_frames=2):
    """A TrackerOutput holding given window predictions (final fields unused by the losses)."""
    batch, tracks = window_tracks.shape[2], window_tracks.shape[4]
    return TrackerOutput(
        torch.zeros(batch, num_frames, tracks, 2),
        torch.zeros(batch, num_frames, tracks),
        None,
        window_tracks,
        window_visibility,
        window_confidence,
        window_starts=starts,
        num_frames=num_frames,
    )


def _batch(tracks, visibility, query_frames):
    queries = torch.cat([query_frames[..., None].float(), torch.zeros(*query_frames.shape, 2)], dim=-1)
    return {"tracks": tracks, "visibility": visibility, "queries": queries}


def test_track_loss_is_huber_over_visible_points_after_the_query_discounted_over_iterations():
    # 1 window of 2 frames, 2 iterations, 2 tracks; truth at the origin
    truth = torch.zeros(1, 2, 2, 2)
    visibility = torch.tensor([[[True, True], [True, False]]])  # track 1 hidden in frame 1
    batch = _batch(truth, visibility, query_frames=torch.tensor([[0, 1]]))  # track 1 queried in frame 1
    errors = torch.tensor([[1.0, 100.0], [3.0, 100.0]])  # per frame and track; 100s are never counted
    first = torch.stack([errors, errors], dim=-1)[None, None, None]  # W I B S N 2
    window_tracks = torch.cat([first, first / 2], dim=1)  # iteration 0, then halved errors
    losses = tracking_losses(_output(window_tracks, torch.zeros(1, 2, 1, 2, 2)), batch, gamma=0.5, huber_delta=2.0)
    # counted: (frame 0, track 0) error 1 and (frame 1, track 0) error 3; track 1 is hidden after its query
    huber = {1.0: 0.5, 3.0: 2.0 * (3.0 - 1.0), 0.5: 0.125, 1.5: 1.125}
    iteration0 = (huber[1.0] + huber[3.0]) / 2
    iteration1 = (huber[0.5] + huber[1.5]) / 2
    assert losses["track"].item() == pytest.approx(0.5 * iteration0 + iteration1)


def test_visibility_loss_counts_hidden_points_but_not_frames_before_the_query():
    batch = _batch(torch.zeros(1, 2, 2, 2), torch.tensor([[[True, False], [False, True]]]), torch.tensor([[0, 1]]))
    logits = torch.tensor([[2.0, -7.0], [-1.0, 3.0]])[None, None, None]  # W J B S N; (frame 0, track 1) not counted
    losses = tracking_losses(_output(torch.zeros(1, 1, 1, 2, 2, 2), logits), batch)
    expected = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-1.0)) + math.log1p(math.exp(-3.0))) / 3
    assert losses["visibility"].item() == pytest.approx(expected)
    assert "confidence" not in losses


def test_confidence_target_is_being_within_the_threshold_of_visible_truth():
    truth = torch.zeros(1, 1, 2, 2)
    batch = _batch(truth, torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([[0, 0]]))
    window_tracks = torch.tensor([[5.0, 0.0], [13.0, 0.0]]).view(1, 1, 1, 1, 2, 2)  # 5 px and 13 px off
    logits = torch.zeros(1, 1, 1, 1, 2)
    output = _output(
        window_tracks, logits, window_confidence=torch.tensor([4.0, 4.0]).view(1, 1, 1, 1, 2), num_frames=1
    )
    losses = tracking_losses(output, batch, confidence_threshold=12.0)
    expected = (math.log1p(math.exp(-4.0)) + math.log1p(math.exp(4.0))) / 2  # confident: right, then wrong
    assert losses["confidence"].item() == pytest.approx(expected)


def test_padding_frames_past_the_clip_are_not_counted():
    output = _output(torch.zeros(2, 1, 1, 4, 1, 2), torch.zeros(2, 1, 1, 4, 1), starts=(0, 2), num_frames=5)
    targets = window_targets(
        output, _batch(torch.zeros(1, 5, 1, 2), torch.ones(1, 5, 1, dtype=torch.bool), torch.zeros(1, 1))
    )
    assert targets.counted[:, 0, :, 0].tolist() == [[True] * 4, [True, True, True, False]]


def test_metrics_follow_tap_vid_at_256_scale():
    # a 128 × 512 video: x errors count 1/2, y errors 2× at the 256 × 256 scale
    truth = torch.zeros(1, 3, 2, 2)
    prediction = truth.clone()
    prediction[0, 1, 0] = torch.tensor([6.0, 0.0])  # 3 px at 256 scale: within 4, 8, 16
    prediction[0, 2, 0] = torch.tensor([0.0, 5.0])  # 10 px: within 16
    prediction[0, 1, 1] = torch.tensor([0.0, 0.4])  # 0.8 px: within all
    true_visible = torch.tensor([[[True, True], [True, True], [True, False]]])
    predicted_visible = torch.tensor([[[False, False], [True, False], [True, False]]])
    metrics = tracking_metrics(prediction, predicted_visible, truth, true_visible, torch.tensor([[0, 0]]), (128, 512))
    # frames after the query: (1, 0), (2, 0), (1, 1) visible; (2, 1) hidden
    assert metrics["delta_avg"].item() == pytest.approx((3 / 5 + 1 / 5 + 5 / 5) / 3)
    assert metrics["occlusion_acc"].item() == pytest.approx(3 / 4)  # (1, 1) is wrongly hidden


@pytest.mark.parametrize("backbone", ["cotracker2_tiny", "cotracker3_tiny", "cotracker3_offline_tiny"])
def test_one_optimisation_step_on_cpu(tmp_path, backbone):
    module = TrackingModule(backbone=backbone, backbone_options={"iters": 2})
    before = [p.detach().clone() for p in module.parameters()]
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=_datamodule())
    assert trainer.global_step == 1 and math.isfinite(float(trainer.callback_metrics["train/loss"]))
    changed = [not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)]
    assert sum(changed) > 0.9 * len(changed)
    expected_parts = {"train/track_loss", "train/visibility_loss"}
    if backbone.startswith("cotracker3"):
        expected_parts.add("train/confidence_loss")
    assert expected_parts <= set(trainer.callback_metrics)


def test_a_checkpoint_rebuilds_the_tracker(tmp_path):
    module = TrackingModule(backbone="cotracker2_tiny", backbone_options={"corr_radius": 1, "attn_impl": "math"})
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=_datamodule(val_clips=0))
    trainer.save_checkpoint(tmp_path / "tracker.ckpt")
    restored = TrackingModule.load_from_checkpoint(tmp_path / "tracker.ckpt")
    assert (
        restored.backbone.correlation.radius == 1
        and restored.backbone.updateformer.time_blocks[0].attn.attn_impl == "math"
    )
    batch = next(iter(_datamodule(val_clips=0).train_dataloader()))
    torch.testing.assert_close(
        restored(batch["video"], batch["queries"]).tracks, module(batch["video"], batch["queries"]).tracks
    )


@pytest.mark.parametrize("backbone", ["cotracker2_tiny", "cotracker3_tiny"])
def test_training_lowers_the_loss_on_synthetic_clips(backbone):
    torch.manual_seed(0)
    batch = next(iter(_datamodule(val_clips=0).train_dataloader()))
    module = TrackingModule(backbone=backbone)
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-3)
    with torch.no_grad():
        before = module.losses(batch)[0]["loss"].item()
    for _ in range(10):
        optimizer.zero_grad()
        module.losses(batch)[0]["loss"].backward()
        optimizer.step()
    with torch.no_grad():
        after = module.losses(batch)[0]["loss"].item()
    assert after < 0.7 * before


def test_validation_logs_loss_and_tap_vid_metrics(tmp_path):
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, val_check_interval=1, limit_val_batches=1)
    trainer.fit(TrackingModule(backbone="cotracker3_tiny"), datamodule=_datamodule(val_clips=2))
    metrics = trainer.callback_metrics
    assert {"val/loss", "val/delta_avg", "val/occlusion_acc"} <= set(metrics)
    assert 0.0 <= float(metrics["val/delta_avg"]) <= 1.0 and 0.0 <= float(metrics["val/occlusion_acc"]) <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": 0.0}, r"`gamma` must be a number > 0 and ≤ 1, got 0.0"),
        ({"gamma": 1.2}, r"`gamma` must be a number > 0 and ≤ 1, got 1.2"),
        ({"huber_delta": -1.0}, r"`huber_delta` must be a number > 0, got -1.0"),
        ({"visibility_weight": -0.5}, r"`visibility_weight` must be a number ≥ 0, got -0.5"),
        ({"confidence_threshold": 0}, r"`confidence_threshold` must be a number > 0, got 0"),
        ({"lr": -1e-4}, r"`lr` must be a number > 0, got -0.0001"),
        ({"warmup_steps": -3}, r"`warmup_steps` must be an integer ≥ 0, got -3"),
        ({"pretrained_weights_only": "sure"}, r"`pretrained_weights_only` must be true or false, got 'sure'"),
        ({"schedule": "step"}, r"Unknown `schedule`='step'; valid choices: polynomial, cosine, constant"),
        ({"backbone": "cotracker9"}, r"Unknown model preset `name`='cotracker9'"),
        ({"backbone_options": {"attn_impl": "xformers"}}, r"Unknown `attn_impl`='xformers'; valid choices: sdpa, math"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    options = {"backbone": "cotracker2_tiny", **kwargs}
    with pytest.raises(ValueError, match=message):
        TrackingModule(**options)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": "0.8"}, r"`gamma` must be a number > 0 and ≤ 1, got '0.8' \(str\)"),
        ({"huber_delta": True}, r"`huber_delta` must be a number > 0, got True \(bool\)"),
        ({"warmup_steps": "ten"}, r"`warmup_steps` must be an integer ≥ 0, got 'ten' \(str\)"),
        ({"power": "square"}, r"`power` must be a number > 0, got 'square' \(str\)"),
        ({"betas": [0.9]}, r"`betas` must be two numbers in \[0, 1\)"),
        ({"backbone": None}, r"`backbone` must be a preset name .*, got None \(NoneType\)"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused(kwargs, message):
    options = {"backbone": "cotracker2_tiny", **kwargs}
    with pytest.raises(TypeError, match=message):
        TrackingModule(**options)


@pytest.mark.parametrize(
    ("model", "params_m"), [("cotracker2", 45.5), ("cotracker3", 25.4), ("cotracker3_offline", 25.4)]
)
def test_model_configs_build_the_published_presets(compose_train, model, params_m):
    cfg = compose_train(f"model={model}", "data=synthetic_tracking")
    with torch.device("meta"):
        module = instantiate(cfg.model)
    assert round(sum(p.numel() for p in module.parameters()) / 1e6, 1) == params_m
    assert module.backbone.model_resolution == (384, 512) and module.backbone.iters == 4


def test_experiments_hold_the_published_settings(compose_train):
    cfg = compose_train("experiment=cotracker2_kubric")
    assert cfg.model.backbone == "cotracker2" and cfg.model.backbone_options.window_len == 8
    assert (cfg.data.sequence_len, cfg.data.traj_per_sample, cfg.model.lr) == (24, 768, 5e-4)
    assert cfg.trainer.precision == "32-true" and cfg.model.backbone_options.iters == 4
    cfg = compose_train("experiment=cotracker3_online")
    assert cfg.model.backbone == "cotracker3" and cfg.model.backbone_options.window_len == 16
    assert (cfg.data.sequence_len, cfg.data.traj_per_sample) == (64, 384)
    assert cfg.trainer.precision == "bf16-mixed"
