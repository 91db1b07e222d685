import os

import pytest
import torch

from lightning_memopt.cli.train import train
from lightning_memopt.memory.allocator import (
    ENV_VAR,
    allocator_retries,
    allocator_settings,
    configure_allocator,
)
from lightning_memopt.memory.allocator import (
    USER_VARIABLES as ALLOCATOR_VARIABLES,
)
from tests.helpers import TINY_FACE


def test_nothing_set_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert configure_allocator() is None
    assert ENV_VAR not in os.environ


def test_settings_are_written_and_merged_with_what_was_there(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "max_split_size_mb:64,roundup_power2_divisions:4")
    value = configure_allocator(expandable_segments=True, max_split_size_mb=128, garbage_collection_threshold=0.6)
    assert value == (
        "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True,garbage_collection_threshold:0.6"
    )
    assert os.environ[ENV_VAR] == value


def test_a_warning_when_cuda_is_already_initialised(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is already initialised"):
        configure_allocator(expandable_segments=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"expandable_segments": "maybe"},
            ValueError,
            r"`expandable_segments` must be true, false, null or auto, got 'maybe'",
        ),
        (
            {"expandable_segments": 2},
            ValueError,
            r"`expandable_segments` must be true, false, null or auto, got 2 \(int\)",
        ),
        ({"max_split_size_mb": 20}, ValueError, r"`max_split_size_mb` must be an integer ≥ 21, got 20"),
        ({"max_split_size_mb": -64}, ValueError, r"`max_split_size_mb` must be an integer ≥ 21, got -64"),
        ({"max_split_size_mb": 64.5}, TypeError, r"`max_split_size_mb` must be an integer ≥ 21, got 64.5 \(float\)"),
        ({"max_split_size_mb": "128"}, TypeError, r"`max_split_size_mb` must be an integer ≥ 21, got '128' \(str\)"),
        ({"max_split_size_mb": True}, TypeError, r"`max_split_size_mb` must be an integer ≥ 21, got True \(bool\)"),
        (
            {"garbage_collection_threshold": 1.0},
            ValueError,
            r"`garbage_collection_threshold` must be a number > 0 and < 1, got 1.0",
        ),
        (
            {"garbage_collection_threshold": "abc"},
            TypeError,
            r"`garbage_collection_threshold` must be a number > 0 and < 1, got 'abc' \(str\)",
        ),
    ],
)
def test_invalid_values_are_rejected_naming_the_option(kwargs, error, message):
    with pytest.raises(error, match=message):
        allocator_settings(**kwargs)


def test_words_from_a_config_are_read_as_booleans():
    assert allocator_settings(expandable_segments="on") == {"expandable_segments": "True"}
    assert allocator_settings(expandable_segments="off") == {"expandable_segments": "False"}
    assert allocator_settings(expandable_segments="null", max_split_size_mb=128.0) == {"max_split_size_mb": "128"}


def test_memopt_train_writes_the_allocator_options_before_it_starts(compose_train, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    train(
        compose_train(*TINY_FACE, "memopt.allocator.expandable_segments=true", "memopt.allocator.max_split_size_mb=256")
    )
    assert os.environ[ENV_VAR] == "expandable_segments:True,max_split_size_mb:256"


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, "expandable_segments:True"),
        ({ENV_VAR: "max_split_size_mb:64"}, "max_split_size_mb:64"),  # the user's settings, untouched
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, None),  # torch's newer name counts too
    ],
)
def test_memopt_train_grows_segments_unless_the_user_configured_the_allocator(
    compose_train, monkeypatch, environment, expected
):
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    train(compose_train(*TINY_FACE))
    assert os.environ.get(ENV_VAR) == expected


def test_auto_is_a_word_of_the_python_function_too(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator_settings(expandable_segments="AUTO") == {"expandable_segments": "True"}
    monkeypatch.setenv(ENV_VAR, "garbage_collection_threshold:0.8")
    assert allocator_settings(expandable_segments="auto") == {}


def test_no_allocator_retries_off_cuda():
    assert allocator_retries("cpu") == 0
    assert allocator_retries(torch.device("meta")) == 0


@pytest.mark.cuda
def test_allocator_retries_count_a_cache_flush():
    torch.cuda.init()
    before = allocator_retries("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2**30 / total)  # 1 GiB
    try:
        block = torch.empty(600 * 2**20, dtype=torch.uint8, device="cuda")
        del block  # cached, not returned
        bigger = torch.empty(700 * 2**20, dtype=torch.uint8, device="cuda")  # fits only once the cache is freed
        del bigger
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert allocator_retries("cuda") > before
