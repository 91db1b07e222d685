"""ActivationCheckpointing({"budget": b}): each block's mode chosen for the budget from a profiled step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_script
from lightning.fabric.utilities.exceptions import MisconfigurationException
from test_activation_checkpointing import TinyViTModule, _fit

from lightning_memopt import ActivationCheckpointing
from lightning_memopt.checkpointing import ActivationBudget, apply_activation_checkpointing, checkpoint_mode
from lightning_memopt.models import create_model
from lightning_memopt.planner import gpu


@pytest.fixture(autouse=True)
def _a100_prices(monkeypatch):
    """Price the options as an A100 would (deterministic; timing this CPU would make the choice vary)."""
    from lightning_memopt.callbacks import activation_checkpointing as callback_module

    monkeypatch.setattr(callback_module, "hardware_for", lambda device, name, budget: gpu("a100_80gb"))


def test_a_budget_checkpoints_the_chosen_blocks_and_keeps_the_result():
    reference = _fit(TinyViTModule(), None)
    callback = ActivationCheckpointing({"budget": 0.6}, sample_batch=(torch.randn(2, 3, 64, 48),))
    checkpointed = _fit(TinyViTModule(), callback)
    assert callback.chosen and set(callback.chosen.values()) <= {"full", "selective", "offload", "lean"}
    assert callback.report.modules == callback.chosen  # what was chosen is what was wrapped
    assert all(checkpoint_mode(m) is None for m in checkpointed.modules())  # removed in teardown
    for (name, expected), got in zip(reference.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.allclose(expected, got, atol=1e-6), name


def test_a_budget_checkpoints_the_head_chain_leanly_only_where_the_plain_chain_misses_it():
    head = ["network.head.upsample.*", "network.head.refine"]
    callback = ActivationCheckpointing({"budget": 0.5, "modules": head}, sample_batch=(torch.randn(2, 3, 128, 96),))
    _fit(TinyViTModule(), callback)
    assert callback.chosen == {"network.head.refine": "lean"}  # only the lean chain meets it
    assert callback.report.modules == {"network.head.refine": "lean"}
    # on the loader's smaller maps another way meets it (plain recomputation, or offload as this CPU prices it): faster
    callback = ActivationCheckpointing({"budget": 0.6})
    _fit(TinyViTModule(), callback)
    assert list(callback.chosen) == ["network.head.refine"] and callback.chosen["network.head.refine"] != "lean"


def test_a_budget_the_activations_fit_checkpoints_nothing_and_the_first_training_batch_is_used():
    callback = ActivationCheckpointing({"budget": 1.0})
    module = _fit(TinyViTModule(), callback)
    assert callback.chosen == {} and callback.report is None
    assert module.modes_seen[0] == [None, None]


def test_outside_a_fit_a_budget_checkpoints_nothing():
    import lightning.pytorch as pl
    from test_activation_checkpointing import _loader

    callback = ActivationCheckpointing({"budget": 0.3})
    pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).validate(
        _ValidatingModule(), _loader()
    )
    assert callback.chosen is None


class _ValidatingModule(TinyViTModule):
    def validation_step(self, batch, batch_idx):
        return self.network(batch[0]).square().mean()


def test_other_ranks_apply_rank_zeros_choice(monkeypatch):
    from lightning.pytorch.strategies import SingleDeviceStrategy

    rank_zero = ActivationCheckpointing({"budget": 0.5}, sample_batch=(torch.randn(2, 3, 64, 48),))
    _fit(TinyViTModule(), rank_zero)
    monkeypatch.setattr(SingleDeviceStrategy, "broadcast", lambda self, obj, src=0: dict(rank_zero.chosen))
    monkeypatch.setattr("lightning.pytorch.Trainer.is_global_zero", property(lambda self: False))
    other = ActivationCheckpointing({"budget": 0.5})  # no batch: only rank 0 profiles one
    _fit(TinyViTModule(), other)
    assert other.chosen == rank_zero.chosen and other.report.modules == rank_zero.chosen


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"budget": 0}, r"`budget`=0 must be a fraction in \(0, 1\]"),
        ({"budget": "half"}, r"`budget`='half' must be a fraction"),
        ({"budget": 0.5, "every_n": 2}, r"Unknown budget policy keys \['every_n'\]; valid keys: budget, modules"),
        (["auto", {"budget": 0.5}], r"a \{'budget': \.\.\.\} policy chooses every block's mode itself; give it alone"),
    ],
)
def test_a_bad_budget_policy_is_refused_naming_it(policy, message):
    with pytest.raises(MisconfigurationException, match=message):
        ActivationCheckpointing(policy)


def test_the_function_refuses_a_budget_and_says_what_measures_one():
    with pytest.raises(
        ValueError, match=r"budget\(0\.5 of the activation peak, auto\) policy is chosen from a measured"
    ):
        apply_activation_checkpointing(create_model("iresnet_tiny"), {"budget": 0.5})
    assert ActivationBudget(3 * 2**30).describe() == "budget(3221225472 bytes, auto)"


@pytest.mark.slow
def test_under_ddp_every_rank_applies_rank_zeros_choice(tmp_path):
    script = Path(__file__).with_name("checkpoint_budget_ddp_run.py")
    result = run_script(script, [str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1))
    assert rank0["own"] == rank0["chosen"] == rank0["wrapped"] and "offload" in rank0["chosen"].values()
    assert rank1["own"] != rank0["chosen"]  # priced on its own, rank 1 would choose other blocks and modes
    assert rank1["chosen"] == rank1["wrapped"] == rank0["chosen"]
