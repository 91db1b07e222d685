"""Shared fixtures: compose the project's Hydra config into a test's temporary directory."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_memopt.cli.config import config_dir


@pytest.fixture
def compose_train(tmp_path):
    """``compose_train(*overrides) -> DictConfig`` of ``train.yaml``, writing under ``tmp_path``."""

    def compose_(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={tmp_path}", *overrides])

    return compose_


# lightning_memopt.planner.calibration.CACHE_VARIABLE, named here without importing the package: the planner loads
# Lightning, which then logs past pytest's capture (it stops propagating to a root logger that has no handler yet)
RATES_CACHE_VARIABLE = "LIGHTNING_MEMOPT_CACHE"


def pytest_configure(config):
    """The CPU's measured rates (``measure_cpu``) cached for this run only: never a developer's stale file."""
    os.environ.setdefault(RATES_CACHE_VARIABLE, tempfile.mkdtemp(prefix="memopt_rates_"))


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``cuda`` on machines without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """Undo what an in-process DDP run leaves behind (MASTER_PORT etc., an open process group)."""
    saved = dict(os.environ)
    yield
    leaked = _get_current_dispatch_mode_stack()
    assert not leaked, f"the test left dispatch modes active: {leaked}"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
