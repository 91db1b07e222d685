"""How the apps end: one line naming what is wrong for a bad input, a traceback only for a fault of ours.

Exit status, the same for every app:

- ``0``: done.
- ``1``: an unexpected error (a fault, not the input): Hydra prints its traceback.
- ``2``: the input cannot run — a config key or group that does not exist, a bad value (its name, the
  value and the valid choices), a missing or unreadable file, a plan that fits nothing, a step too big
  even for one sample. One line on stderr, no traceback.
- ``130``: stopped with Ctrl-C (``memopt-train``: once, after the step in progress and saving ``last.ckpt``;
  twice, at once).

A command line Hydra cannot compose (an unknown group option or key, a bad override) is said in one line
too, with the key, the value and the valid choices (:func:`config_error`): Hydra's own report takes 7–26 lines
and names no near key.

``--debug`` on the command line (or ``HYDRA_FULL_ERROR=1``) shows the traceback of a bad input too.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, InstantiationException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from lightning_memopt.arguments import InputError
from lightning_memopt.cli.config import config_dir, dotted_keys, with_config_keys

# What torch puts into the message of an error re-raised from a DataLoader worker, before the worker's traceback
WORKER_TRACEBACK = "Original Traceback (most recent call last)"

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

# Errors that always mean a bad input: worded for the user (Lightning's configuration errors, Hydra's and
# OmegaConf's, ours for a step too large or for malformed data, a missing file or package). Lightning's and
# ours for a step too large come from `_worded_for_users`: this module imports neither torch nor Lightning.
_WORDED_FOR_USERS: tuple[type[BaseException], ...] = (
    OmegaConfBaseException,
    HydraException,
    InputError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    ModuleNotFoundError,  # an optional package missing (faiss, prometheus_client, torch_xla for accelerator=tpu)
)


def _worded_for_users() -> tuple[type[BaseException], ...]:
    """The error classes worded for users, imported when an error is classified.

    Lightning's ``MisconfigurationException`` and our ``SampleOutOfMemoryError`` are imported only once torch
    is: before that no instance of them can exist, and a bad input found early (a Trainer option, before the
    run is built) is told at once, without loading torch.

    Example::

        >>> from lightning.fabric.utilities.exceptions import MisconfigurationException
        >>> MisconfigurationException in _worded_for_users()
        True
    """
    if "torch" not in sys.modules:
        return _WORDED_FOR_USERS
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_memopt.accumulation import SampleOutOfMemoryError

    return (*_WORDED_FOR_USERS, MisconfigurationException, SampleOutOfMemoryError)


def debugging() -> bool:
    """True when tracebacks were asked for (``--debug`` or ``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def fail(app: str, message: str) -> NoReturn:
    """Print ``app: message`` on stderr and exit with status 2."""
    print(f"{app}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_INPUT)


def _input_error(error: BaseException, building: bool) -> BaseException | None:
    """The bad-input error behind ``error`` (Hydra wraps what a constructor raises), else ``None``.

    A ``ValueError`` / ``TypeError`` is a bad input while the run is being built (constructors check their
    arguments), and later only when it names an argument (in backticks, as our checks and Lightning's do);
    elsewhere it is a fault (a shape error in a training step) and keeps its traceback.
    """
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, _worded_for_users()):
        return error
    if isinstance(error, ValueError | TypeError) and (building or "`" in str(error)):
        return error
    return None


@contextmanager
def input_errors(app: str, building: bool = False, config: DictConfig | None = None) -> Iterator[None]:
    """End a bad input's error with one line and exit status 2 (re-raised as it is with ``--debug``).

    Args:
        app: the name the line starts with.
        building: the block builds the run from its config (any ``ValueError`` / ``TypeError`` is then the
            input's); otherwise it runs it.
        config: the run's config: an argument the line names (`` `batch_size` ``) is written as the key that sets it
            (`` `data.batch_size` ``; :func:`~lightning_memopt.cli.config.with_config_keys`).

    Example::

        >>> with input_errors("memopt-demo"):  # doctest: +SKIP
        ...     raise ValueError("`batch_size` must be an integer ≥ 1, got 'abc' (str)")
    """
    try:
        yield
    except Exception as error:
        cause = _input_error(error, building)
        if cause is None or debugging():
            raise
        if config is None:
            fail(app, describe(cause))
        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        fail(app, with_config_keys(describe(cause), config, overrides))


def describe(error: BaseException) -> str:
    """One line for ``error``. A generic one that names no argument (our checks quote names in backticks) gets
    its type and a pointer to ``--debug``.

    Example::

        >>> describe(ValueError("`batch_size` must be an integer ≥ 1, got 0"))
        '`batch_size` must be an integer ≥ 1, got 0'
        >>> describe(TypeError("unsupported operand"))
        'TypeError: unsupported operand (--debug shows where)'
    """
    text = str(error)
    if WORKER_TRACEBACK in text:  # DataLoader workers re-raise with the worker's traceback in the message
        text = text.rstrip().splitlines()[-1].split(": ", 1)[-1]
    text = " ".join(text.split()) or type(error).__name__
    if "`" in text or isinstance(error, _worded_for_users()):
        return text
    return f"{type(error).__name__}: {text} (--debug shows where)"


def run_hydra_app(app: str, hydra_main: Callable[[], Any], config_name: str | None = None) -> None:
    """Run a ``@hydra.main`` function as ``app``'s entry point with the exit statuses above.

    Takes ``--debug`` off the command line (setting ``HYDRA_FULL_ERROR=1``). A command line that
    ``config_name`` cannot be composed from (an unknown group option or key, a bad override) ends in one line
    naming the key, the value and the valid choices, status 2
    (:func:`config_error`); what Hydra still refuses before the task
    starts ends with its own message, status 2 too.
    """
    if "--debug" in sys.argv[1:]:
        sys.argv = [sys.argv[0], *(arg for arg in sys.argv[1:] if arg != "--debug")]
        os.environ["HYDRA_FULL_ERROR"] = "1"
    if config_name is not None and not debugging():
        error = config_error(config_name, sys.argv[1:])
        if error is not None:
            fail(app, error)
    started = _tasks_started
    try:
        hydra_main()
    except SystemExit as stop:
        if stop.code == 1 and _tasks_started == started and not debugging():
            raise SystemExit(EXIT_BAD_INPUT) from None
        raise


_tasks_started = 0  # tasks Hydra started in this process: a config was composed


def task_started() -> None:
    """Mark that Hydra composed the config and called the task; call it first in a ``@hydra.main`` function."""
    global _tasks_started
    _tasks_started += 1


# command-line flags after which the apps compose nothing themselves: Hydra answers them as it does
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion", "-cp",
                "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")  # fmt: skip
# group options that come with an extra of the package: group/option → the extra
_EXTRAS = {
    "hydra/sweeper/optuna": "optuna",
    "hydra/launcher/submitit_slurm": "slurm",
    "hydra/launcher/joblib": "joblib",
}


def config_error(config_name: str, arguments: list[str]) -> str | None:
    """The first thing Hydra cannot compose from ``arguments`` (the app's command line), in one line; ``None``
    when it composes, or when ``arguments`` hold a flag Hydra answers itself (``--help``, ``--cfg``, …).

    The apps compose the command line's overrides once before Hydra runs (sweeps of ``-m`` left to Hydra) and
    stop at the first error with this line.

    Example::

        >>> print(config_error("train", ["trainer.max_step=2"]))  # doctest: +ELLIPSIS
        `trainer.max_step`: no such key in the config; did you mean `trainer.max_steps`, `trainer.max_epochs`? (a ...
        >>> config_error("train", ["trainer.max_steps=2"]) is None
        True
    """
    if any(argument.split("=")[0] in _HYDRA_FLAGS for argument in arguments):
        return None
    overrides = [argument for argument in arguments if not argument.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        return describe(error)
    plain = [override.input_line for override in parsed if not override.is_sweep_override()]
    with initialize_config_dir(config_dir(), version_base="1.3"):
        try:
            compose(config_name, overrides=plain, return_hydra_config=True)
        except MissingConfigException as error:
            return _missing_option(error)
        except ConfigCompositionException as error:
            return _unknown_key(config_name, error, plain)
        except (HydraException, OmegaConfBaseException) as error:
            return describe(error)
    return None


def _missing_option(error: MissingConfigException) -> str:
    """``memopt=checkpoint`` → the group's valid choices; an option of an extra → the extra to install."""
    missing = error.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    extra = _EXTRAS.get(missing)
    if extra is not None:
        return f'`{group}={option}` needs the {extra} extra: pip install "lightning-memopt[{extra}]"'
    if not group:
        return describe(error)
    options = error.options or GlobalHydra.instance().config_loader().get_group_options(group)
    return f"`{group}={option}`: no such option of `{group}`; valid choices: {', '.join(sorted(options))}"


def _unknown_key(config_name: str, error: ConfigCompositionException, overrides: list[str]) -> str:
    """``trainer.max_step=2`` → the nearest keys anywhere in the config, and how to add a new one."""
    found = re.search(r"Could not override '([^']+)'", str(error))
    if found is None:
        return describe(error)
    key = found.group(1)
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "…")
    others = [o for o in overrides if o.split("=", 1)[0] != key]
    try:
        config = compose(config_name, overrides=others)
    except (HydraException, OmegaConfBaseException):
        config = None
    near = difflib.get_close_matches(key, dotted_keys(config), n=3, cutoff=0.75) if config is not None else []
    named = ", ".join(f"`{name}`" for name in near)
    hint = f"; did you mean {named}?" if near else ""
    return f"`{key}`: no such key in the config{hint} (a new key: +{key}={value})"
