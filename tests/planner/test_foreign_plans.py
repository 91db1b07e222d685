"""plan() on models that declare nothing, and on micro-batches a model refuses."""

import pytest
import torch

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory import SimulatedDevice, profile_step
from lightning_memopt.planner import Knobs, PlanError, gpu, plan, with_budget
from lightning_memopt.planner.space import DEFAULT_SAFETY_MARGIN
from lightning_memopt.tasks import FaceRecognitionModule
from tests.foreign_models import StagedCNN, TinyViT, Unrepeated, classification_loss, image_batch
from tests.helpers import tensors_only

_MIB = 2**20
BATCH = image_batch(16)


def _optimizer(parameters):
    return torch.optim.AdamW(parameters)


def _fake_peak(build, policy):
    def prepare(model):
        if policy is not None:
            apply_activation_checkpointing(model, policy)

    profile = profile_step(
        build,
        BATCH,
        loss_fn=classification_loss,
        optimizer=_optimizer,
        mode="fake",
        warm_optimizer=True,
        steps=1,
        prepare_model=prepare,
    )
    return profile.peak_bytes


def _real_peak(build, knobs: Knobs, budget_bytes: int) -> int:
    """Two real CPU steps with ``knobs`` inside a SimulatedDevice of the budget (it raises past it)."""
    with SimulatedDevice(budget_bytes) as device:
        torch.manual_seed(0)
        model = build()
        if knobs.checkpoint_policy() is not None:
            apply_activation_checkpointing(model, knobs.checkpoint_policy())
        optimizer = _optimizer(model.parameters())
        for _ in range(2):
            classification_loss(model, BATCH).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return device.peak.total_bytes


def _plan_between_the_peaks(build, unchecked: int, checkpointed: int, **options):
    """fp32 plans without micro-batches at a budget between the two peaks (10 % safety margin taken): plan, budget."""
    budget = (unchecked + checkpointed) / 2 / (1 - DEFAULT_SAFETY_MARGIN)
    hardware = tensors_only(with_budget(gpu("a100_80gb"), budget / 2**30))
    options = {"precisions": ["32-true"], "micro_batching": False, **options}
    return plan(build, BATCH, hardware, loss_fn=classification_loss, optimizer=_optimizer, **options), budget


@pytest.mark.parametrize("build", [TinyViT, StagedCNN])
def test_a_budget_only_checkpointing_meets_gets_a_plan_on_the_discovered_blocks(build):
    unchecked, checkpointed = _fake_peak(build, None), _fake_peak(build, "auto")
    assert checkpointed < 0.9 * unchecked
    result, budget = _plan_between_the_peaks(build, unchecked, checkpointed)
    assert result.chosen is not None, result.table()
    assert result.chosen.knobs.checkpoint != "none"
    assert "discovered" in "\n".join(result.notes)
    assert _real_peak(build, result.chosen.knobs, int(budget)) <= budget


def test_explicit_blocks_replace_discovery_and_must_match():
    hardware = with_budget(gpu("a100_80gb"), 1.0)
    result = plan(
        TinyViT,
        BATCH,
        hardware,
        loss_fn=classification_loss,
        optimizer=_optimizer,
        precisions=["32-true"],
        micro_batching=False,
        blocks="encoder.layers.*.mlp",
    )
    assert "checkpointing acts on the 4 modules `blocks` selects" in result.notes
    with pytest.raises(PlanError, match=r"`blocks`='decoder\.\*' match no module of the model; module classes"):
        plan(TinyViT, BATCH, hardware, loss_fn=classification_loss, optimizer=_optimizer, blocks="decoder.*")
    with pytest.raises(ValueError, match=r"`blocks`=12 must be 'auto' \(the blocks the model declares"):
        plan(TinyViT, BATCH, hardware, loss_fn=classification_loss, optimizer=_optimizer, blocks=12)


def test_a_model_with_nothing_repeated_is_planned_without_checkpointing_and_says_so():
    def loss_fn(model, batch):
        return model(batch[0]).square().mean()

    result = plan(
        Unrepeated,
        BATCH,
        with_budget(gpu("a100_80gb"), 1.0),
        loss_fn=loss_fn,
        optimizer=_optimizer,
        precisions=["32-true"],
        micro_batching=False,
    )
    assert result.chosen is not None and result.chosen.knobs.checkpoint == "none"
    assert any(note.startswith("checkpointing not considered: the model declares no blocks") for note in result.notes)
    assert {c.knobs.checkpoint for c in result.candidates} == {"none"}


FACE_PRESETS = [
    "iresnet_tiny",
    "r18",
    *(pytest.param(n, marks=pytest.mark.slow) for n in ("r34", "r50", "r100", "r200")),
]


@pytest.mark.parametrize("backbone", FACE_PRESETS)
def test_micro_batches_of_one_on_a_face_preset_are_left_out_with_the_reason(backbone):
    size = 32 if backbone == "iresnet_tiny" else 112
    batch = (torch.randn(4, 3, size, size), torch.randint(0, 8, (4,)))

    def build():
        return FaceRecognitionModule(num_classes=8, backbone=backbone)

    whole = profile_step(build, batch, mode="fake", steps=1, warm_optimizer=True, round_to=512).breakdown
    trainable = sum(p.numel() * 4 for p in build().parameters() if p.requires_grad)
    states = whole["parameters"] + trainable + whole["optimizer_state"]
    budget = (states + 2**16) / (
        1 - DEFAULT_SAFETY_MARGIN
    )  # just above the model states: nothing fits, so every group is profiled
    result = plan(
        build,
        batch,
        tensors_only(with_budget(gpu("a100_80gb"), budget / 2**30)),
        precisions=["32-true"],
        cpu_offload=(False,),  # (offloaded, the model states would leave room)
    )
    refused = [(knobs.micro_batch_size, reason) for knobs, reason in result.rejected]
    assert refused and refused[0][0] == 1, result.table()
    assert "the model refuses micro-batches of 1 (ValueError: Expected more than 1 value per channel" in refused[0][1]
    assert "left out: the model refuses micro-batches of 1" in result.table()
    assert any(c.knobs.micro_batch_size == 2 for c in result.candidates)  # the sizes it takes were weighed


def test_a_transformers_model_is_planned_with_the_defaults():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64
    )
    config.num_labels = 10

    def build():
        return transformers.ViTForImageClassification(config)

    def loss_fn(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)

    result = plan(build, BATCH, with_budget(gpu("a100_80gb"), 1.0), loss_fn=loss_fn, optimizer=_optimizer)
    assert result.chosen is not None and result.chosen.fits
    assert "checkpointing acts on 4 blocks (ViTLayer ×4; discovered)" in result.notes
    assert any(c.knobs.checkpoint != "none" for c in result.candidates)  # the discovered blocks were weighed


def test_an_estimate_that_fits_is_confirmed_even_when_the_tries_went_to_estimates_over_the_limit():
    unchecked, checkpointed = _fake_peak(TinyViT, None), _fake_peak(TinyViT, "auto")
    result, _ = _plan_between_the_peaks(TinyViT, unchecked, checkpointed, verify=0)
    assert result.chosen is not None and result.chosen.how == "profiled", result.table()
    assert result.chosen.peak_bytes <= result.limit_bytes
