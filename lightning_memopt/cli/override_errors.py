"""What Hydra cannot compose from a command line, said in one line: the key, the value, the valid choices.

Hydra reports an unknown group option or key in 7–26 lines (its search path, a pointer to
``HYDRA_FULL_ERROR``) and, for a key, without the names it could have been. The apps compose the
command line's overrides once before Hydra runs (sweeps of ``-m`` left to Hydra) and stop at the
first error with :func:`config_error`'s line.

Example::

    >>> print(config_error("train", ["trainer.max_step=2"]))  # doctest: +ELLIPSIS
    `trainer.max_step`: no such key in the config; did you mean `trainer.max_steps`, `trainer.max_epochs`? (a ...
    >>> config_error("train", ["trainer.max_steps=2"]) is None
    True
"""

from __future__ import annotations

import difflib
import re

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from lightning_memopt.cli.config import config_dir, dotted_keys
from lightning_memopt.cli.errors import describe

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
    when it composes, or when ``arguments`` hold a flag Hydra answers itself (``--help``, ``--cfg``, …)."""
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
