"""Shared fixtures: compose the project's Hydra config into a test's temporary directory."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_memopt.cli.config import config_dir


@pytest.fixture
def compose_train(tmp_path):
    """``compose_train(*overrides) -> DictConfig`` of ``train.yaml``, writing under ``tmp_path``."""

    def compose_(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={tmp_path}", *overrides])

    return compose_
