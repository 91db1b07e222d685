"""What Hydra cannot compose from a command line ends in one line naming the key, the value and the choices."""

from __future__ import annotations

import pytest
from hydra.errors import MissingConfigException

from lightning_memopt.cli.errors import _missing_option, config_error
from tests.helpers import TINY_FACE, run_memopt_train


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["model=r1000"], "`model=r1000`: no such option of `model`; valid choices: cotracker2, cotracker2_tiny,"),
        (["memopt=[monitor,checkpoint]"], "`memopt=checkpoint`: no such option of `memopt`; valid choices: adaptive, "),
        (
            ["trainer.max_step=2"],
            "`trainer.max_step`: no such key in the config; did you mean `trainer.max_steps`, `trainer.max_epochs`? "
            "(a new key: +trainer.max_step=2)",
        ),
        (
            ["memopt=checkpointing", "callbacks.activation_checkpointing.policy=selectve"],
            "`callbacks.activation_checkpointing.policy`: no such key in the config; did you mean "
            "`memopt.callbacks.activation_checkpointing.policy`",
        ),
    ],
)
def test_a_bad_override_is_one_line_with_the_valid_choices(arguments, expected):
    error = config_error("train", arguments)
    assert error is not None and error.startswith(expected) and "\n" not in error


@pytest.mark.parametrize(
    "arguments",
    [
        ["trainer.max_steps=2", "model=r18"],
        ["-m", "data.batch_size=32,64"],  # a sweep is Hydra's to expand
        ["--cfg", "job", "model=r1000"],  # flags Hydra answers itself
        ["--help"],
    ],
)
def test_what_composes_or_is_hydras_own_is_left_to_hydra(arguments):
    assert config_error("train", arguments) is None


def test_an_option_of_an_extra_says_which_extra_to_install():
    missing = MissingConfigException("Could not find 'hydra/sweeper/optuna'", "hydra/sweeper/optuna", ["basic"])
    assert (
        _missing_option(missing)
        == '`hydra/sweeper=optuna` needs the optuna extra: pip install "lightning-memopt[optuna]"'
    )


def test_memopt_train_ends_a_bad_key_in_one_line_with_status_2(tmp_path):
    done = run_memopt_train([*TINY_FACE, "trainer.max_step=2"], tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "memopt-train: `trainer.max_step`: no such key in the config; did you mean `trainer.max_steps`, "
        "`trainer.max_epochs`? (a new key: +trainer.max_step=2)"
    ]
