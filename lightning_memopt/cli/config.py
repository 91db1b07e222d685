"""Locate the Hydra config tree, build objects from its groups, and send Lightning's log lines to Hydra's job log.

:func:`finish_logger_runs` ends the logger runs that outlive a fit, so each job of a multirun logs a run of its own.
:func:`with_config_keys` writes an argument an error names as the config key that sets it (`` `data.batch_size` ``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig


def config_dir() -> str:
    """Absolute path of the ``conf/`` tree: the copy installed with the package, else the checkout's.

    Example::

        >>> (Path(config_dir()) / "train.yaml").is_file()
        True
    """
    installed = Path(str(resources.files("lightning_memopt"))) / "conf"
    if (installed / "train.yaml").is_file():
        return str(installed)
    return str(Path(__file__).resolve().parents[2] / "conf")


def instantiate_named(group: DictConfig | None, what: str) -> list[Any]:
    """Instantiate every entry of a ``name -> {_target_: ...}`` mapping; ``null`` entries are skipped.

    Args:
        group: the mapping (e.g. ``cfg.callbacks``), or ``None`` for none.
        what: the mapping's key in the config, for error messages (e.g. ``"callbacks"``).

    Raises:
        ValueError: for an entry that is not a config with a ``_target_``.

    Example::

        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"a": {"_target_": "datetime.timedelta", "days": 1}, "b": None})
        >>> instantiate_named(cfg, "callbacks")
        [datetime.timedelta(days=1)]
    """
    objects = []
    for key, entry in (group or {}).items():
        name = str(key)
        if entry is None:
            continue
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise ValueError(
                f"`{what}.{name}` must be a config with a `_target_` (or null to disable it), got {entry!r}"
            )
        objects.append(instantiate(entry))
    return objects


# Lightning's loggers: `lightning` always adds a console handler ("INFO: …") on import; `lightning.pytorch` and
# `lightning.fabric` add one each (no formatter) and stop propagating when imported while the root logger has no
# handler (before Hydra's job logging is set up).
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def route_lightning_logs() -> int:
    """Send Lightning's log lines through the root logger: to Hydra's job log file, and once to the console.

    Call it in a Hydra task (Hydra has configured the root logger then). Lightning is imported here (the
    run imports it anyway); the console handlers Lightning added to its own loggers are removed and those
    loggers propagate, so ``<run dir>/<job name>.log`` gets "GPU available: …", "`Trainer.fit` stopped: …"
    and ``rank_zero_info`` lines, and the console shows each once, in Hydra's format. Handlers configured
    by someone else are kept; without a handler on the root logger (``hydra/job_logging=none``) nothing
    is changed.

    Returns:
        The number of Lightning's console handlers removed.

    Example::

        >>> import logging
        >>> loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
        >>> saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
        >>> logging.getLogger().addHandler(job_log := logging.NullHandler())  # what Hydra's job logging adds
        >>> _ = route_lightning_logs()
        >>> [logger.propagate for logger in loggers]
        [True, True, True]
        >>> logging.getLogger().removeHandler(job_log)
        >>> for logger, (handlers, propagate) in zip(loggers, saved):  # as it was, for the other examples
        ...     logger.handlers[:], logger.propagate = handlers, propagate
    """
    import lightning.pytorch  # noqa: F401  (its loggers set up as Lightning sets them up on import)

    from lightning_memopt.private_api import lightning_console_handler

    if not logging.getLogger().handlers:
        return 0
    removed = 0
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            ours = handler is lightning_console_handler() or (
                type(handler) is logging.StreamHandler and handler.formatter is None
            )
            if ours:
                logger.removeHandler(handler)
                logger.propagate = True
                removed += 1
    return removed


def with_config_keys(message: str, cfg: DictConfig, overrides: Sequence[str] = ()) -> str:
    """``message`` with each argument it names in backticks (`` `batch_size` ``) written as the config key that
    sets it (`` `data.batch_size` ``): the key the user typed among ``overrides`` (or set inside one they typed,
    ``knobs={precision:fp8}``), else the config's only key of that name; a name no key or several keys end in stays
    as it is.

    Example::

        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"data": {"batch_size": -4}, "model": {"warmup_steps": 9, "lr": 0.1}})
        >>> with_config_keys("`batch_size` must be an integer ≥ 1, got -4", cfg)
        '`data.batch_size` must be an integer ≥ 1, got -4'
        >>> cfg = OmegaConf.create({"trainer": {"precision": "32"}, "knobs": {"precision": "fp8"}})
        >>> with_config_keys("Unknown `precision`='fp8'", cfg, ["knobs={precision:fp8}"])
        "Unknown `knobs.precision`='fp8'"
    """
    keys = [key for key in dotted_keys(cfg) if not key.startswith("hydra.")]
    typed = [override.split("=", 1)[0].lstrip("+~") for override in overrides]

    def full_key(found: re.Match[str]) -> str:
        name = found.group(1)
        if name in keys:
            return found.group(0)
        ending = [key for key in keys if key.endswith(f".{name}")]
        chosen = [key for key in ending if any(key == t or key.startswith(f"{t}.") for t in typed)] or ending
        return f"`{chosen[0]}`" if len(chosen) == 1 else found.group(0)

    return re.sub(r"`(\w+)`", full_key, message)


def dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every key of ``node`` as a dotted path (interpolations left unresolved)."""
    keys = []
    for name, child in node.items_ex(resolve=False):
        path = f"{prefix}{name}"
        keys.append(path)
        if isinstance(child, DictConfig):
            keys += dotted_keys(child, f"{path}.")
    return keys


def finish_logger_runs(loggers: Iterable[Any], exit_code: int = 0) -> int:
    """Finish the W&B run a ``WandbLogger`` in ``loggers`` started (``wandb.finish``); returns how many (0 or 1).

    Lightning finalises its loggers at the end of ``fit`` but leaves a Weights & Biases run open (it is
    a process-wide object that ``wandb`` finishes at exit). Under Hydra's basic launcher every job of a
    sweep runs in one process, so without this every job would append to the first job's W&B run.

    A later ``WandbLogger`` then starts a new run instead of attaching to the finished one.

    Args:
        loggers: the Trainer's loggers.
        exit_code: 0 for a fit that ended normally; anything else marks the W&B run failed.

    Example::

        >>> finish_logger_runs([])
        0
    """
    from lightning.pytorch.loggers import WandbLogger

    if not any(isinstance(logger, WandbLogger) for logger in loggers):
        return 0
    import wandb

    if wandb.run is None:  # never started (another rank, or nothing logged)
        return 0
    wandb.finish(exit_code=exit_code)
    return 1
