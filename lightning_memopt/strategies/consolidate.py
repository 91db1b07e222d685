"""Consolidate a sharded (distributed) fsdp_memopt checkpoint into one file that loads into the plain model."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_memopt.arguments import check_path

# Lightning writes the checkpoint's other contents (loops, callbacks, hyper-parameters) beside the shards in this file
LIGHTNING_METADATA = "meta.pt"
DCP_METADATA = ".metadata"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``torch.distributed.checkpoint`` (one shard per rank).

    Example::

        >>> is_sharded_checkpoint("no/such/folder")
        False
    """
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


def check_checkpoint(name: str, path: object) -> str:
    """``path`` as a checkpoint that loads: a whole ``torch.save`` file, or a sharded checkpoint folder.

    Cheap: the archive's directory is read, not its tensors.

    Raises:
        TypeError: not a path.
        FileNotFoundError: nothing at ``path``.
        ValueError: a file that is not a whole ``torch.save`` archive (truncated, or another format),
            or a folder that is not a sharded checkpoint.

    Example::

        >>> check_checkpoint("ckpt_path", "no/such.ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: `ckpt_path`: no checkpoint at 'no/such.ckpt'
    """
    path = check_path(name, path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"`{name}`: no checkpoint at {path!r}")
    if os.path.isdir(path):
        if not is_sharded_checkpoint(path):
            raise ValueError(f"`{name}`: the folder {path!r} is not a sharded checkpoint (it has no {DCP_METADATA})")
    elif not zipfile.is_zipfile(path):
        raise ValueError(
            f"`{name}`: {path!r} is not a readable checkpoint (truncated, or not written by torch.save /"
            " Trainer.save_checkpoint)"
        )
    return path


def consolidate_checkpoint(folder: str | Path, output: str | Path | None = None) -> dict[str, Any]:
    """The full checkpoint in a sharded checkpoint folder, written to ``output`` if given.

    ``state_dict`` holds every tensor whole under the module's own names (FSDP2 inserts none),
    so ``LightningModule.load_from_checkpoint`` or ``module.load_state_dict(checkpoint["state_dict"])``
    take it without a strategy; ``optimizer_states`` keeps each optimizer's state keyed by
    parameter name, as the sharded checkpoint has it. Everything is read into host memory.

    Raises:
        FileNotFoundError: ``folder`` is not a sharded checkpoint (naming what it is).

    Example::

        >>> consolidate_checkpoint("no/such/folder")
        Traceback (most recent call last):
        ...
        FileNotFoundError: no/such/folder is not a sharded checkpoint (a folder with .metadata): it does not exist
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(folder)
    if not is_sharded_checkpoint(folder):
        what = "it does not exist" if not folder.exists() else f"a {'folder' if folder.is_dir() else 'file'}"
        raise FileNotFoundError(f"{folder} is not a sharded checkpoint (a folder with {DCP_METADATA}): {what}")
    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        checkpoint: dict[str, Any] = torch.load(whole, map_location="cpu", weights_only=False)
    optimizers = sorted((key for key in checkpoint if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizers]
    metadata = folder / LIGHTNING_METADATA
    if metadata.is_file():
        checkpoint.update(torch.load(metadata, map_location="cpu", weights_only=False))
    if output is not None:
        torch.save(checkpoint, output)
    return checkpoint
