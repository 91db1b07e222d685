"""Locate the Hydra config tree and build objects from its groups."""

from __future__ import annotations

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
