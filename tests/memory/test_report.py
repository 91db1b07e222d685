"""OOM reports and profile tables: activations by block wherever the blocks sit, and advice a run can follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_memopt.cli.config import config_dir
from lightning_memopt.memory import profile_step
from lightning_memopt.memory.report import format_report, suggestions
from lightning_memopt.memory.tracker import MemoryTracker
from tests.helpers import ResidualMLP


class ViTLike(nn.Module):
    """Its blocks in a ModuleList, called one by one: the ModuleList itself never runs."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(ResidualMLP() for _ in range(depth))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _peak_of_a_step():
    model = ViTLike()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = MemoryTracker.start_training_step(model, [optimizer], torch.randn(32, 100, 16))
    loss = model(torch.randn(32, 100, 16)).mean()
    tracker.phase = "backward"
    loss.backward()
    tracker.close()
    return tracker.peak


def test_an_oom_report_names_the_blocks_of_a_module_list_and_how_much_checkpointing_them_saves():
    peak = _peak_of_a_step()
    by_block = peak.activations_by_block()
    assert sorted(by_block, key=lambda name: int(name.split(".")[1])) == [f"blocks.{i}" for i in range(12)]
    by_module = peak.activations_by_module()  # the ModuleList's members carry its name (not "<root>")
    assert next(iter(by_module)) == "blocks" and by_module["blocks"] == sum(by_block.values())
    remedy, saved, _ = next(item for item in suggestions(peak) if "checkpointing" in item[0])
    assert remedy.startswith("activation checkpointing of its 12 blocks (blocks.0 … blocks.11;")
    assert "memopt=checkpointing" in remedy and (Path(config_dir()) / "memopt" / "checkpointing.yaml").is_file()
    assert saved == sum(by_block.values()) - max(by_block.values())
    report = format_report(peak, "out of memory at step 0", devices=1)
    assert "activations by block (12 blocks" in report and "  4 more " in report  # 8 largest, then the rest
    assert "halve the batch size and accumulate over 2 (data.batch_size=<half>" in report
    assert "needs more devices than this run's 1; the estimate is for 2" in report and "8 GPUs" not in report


def test_sharding_advice_uses_the_devices_the_run_has():
    peak = _peak_of_a_step()
    state = sum(peak.by_category()[key] for key in ("parameters", "gradients", "optimizer_state"))
    remedy, saved, basis = next(item for item in suggestions(peak, devices=4) if "sharding" in item[0])
    assert "over the run's 4 devices (strategy=fsdp_memopt)" in remedy
    assert saved == state * 3 // 4 and basis.startswith("3/4")


def test_a_profile_table_lists_the_blocks_it_found_and_refuses_an_unknown_blocks_word():
    def step(blocks):
        return profile_step(
            ViTLike(),
            torch.randn(8, 100, 16),
            loss_fn=lambda m, x: m(x).mean(),
            optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
            mode="fake",
            blocks=blocks,
        )

    profile = step("auto")
    assert len(profile.activations_by_block) == 12 and len(profile.blocks) == 12
    assert "activations by block (12)" in profile.table() and "  4 more" in profile.table()
    assert step(()).activations_by_block == {}
    with pytest.raises(ValueError, match=r"Unknown `blocks`='all'; valid choices: 'auto' or a tuple of submodule"):
        step("all")
