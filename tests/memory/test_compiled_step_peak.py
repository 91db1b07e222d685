"""predict_compiled_step: a compiled step's memory from its partitioned graphs in fake mode, against the CPU
allocator running the same compiled step (aot_eager_decomp_partition: the graphs op by op)."""

import pytest
import torch
from torch import nn

from lightning_memopt.memory.compiled_step import predict_compiled_step
from lightning_memopt.models import create_model
from tests.helpers import load_benchmark

compile_budget = load_benchmark("claims.compile_budget")


def _measured(build, batch, budget):
    """The allocator's peak of a compiled step (gradients already allocated, as compile_budget measures it)."""
    torch._dynamo.reset()
    variant = compile_budget.compiled_variant(build, batch, "aot_eager_decomp_partition", budget)
    for parameter in variant.model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    measured = compile_budget.allocator_peak(lambda: variant.forward(batch))
    torch._dynamo.reset()
    return measured


def _two_vit_blocks():
    torch.manual_seed(0)
    return nn.Sequential(*create_model("sapiens_tiny").backbone.blocks)


def _conv_bn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
    )


# at the ends the partitioner's choice is fixed (all it may save, nothing); between, its knapsack may choose a little
# otherwise on dynamo's graph than on the one traced here
@pytest.mark.parametrize(("budget", "within"), [(1.0, 0.001), (0.5, 0.1), (0.0, 0.001)])
def test_a_compiled_transformers_step_is_predicted_as_the_allocator_counts_it(budget, within):
    batch = (torch.randn(2, 48, 64),)
    measured = _measured(_two_vit_blocks, batch, budget)
    predicted = predict_compiled_step(_two_vit_blocks, batch, lambda model, b: model(*b).square().mean(), budget)
    assert predicted.after_forward == pytest.approx(measured.after_forward, rel=within, abs=32 * 1024)
    assert predicted.peak_bytes == pytest.approx(measured.peak, rel=within)


def test_a_compiled_convolution_step_with_batch_norm_is_predicted_within_the_convolutions_workspace():
    """The allocator also counts the workspace a convolution's backward takes, which no tensor of the graph holds:
    within a quarter, the bound the eager tracker has against the same allocator."""
    batch = (torch.randn(4, 3, 32, 32),)
    for budget in (1.0, 0.3):
        measured = _measured(_conv_bn, batch, budget)
        predicted = predict_compiled_step(_conv_bn, batch, lambda model, b: model(*b).square().mean(), budget)
        assert predicted.peak_bytes <= measured.peak <= 1.25 * predicted.peak_bytes


def test_a_lower_budget_saves_less_and_a_budget_outside_zero_to_one_is_refused():
    batch = (torch.randn(2, 48, 64),)
    loss = lambda model, b: model(*b).square().mean()  # noqa: E731
    saved = [predict_compiled_step(_two_vit_blocks, batch, loss, budget).saved_bytes for budget in (1.0, 0.5, 0.0)]
    assert saved[0] > saved[1] > saved[2]
    with pytest.raises(ValueError, match=r"`budget`=1.5 must be within \[0, 1\]"):
        predict_compiled_step(_two_vit_blocks, batch, loss, 1.5)
