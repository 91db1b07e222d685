"""Consolidate a sharded (distributed) fsdp_memopt checkpoint into one file that loads into the plain model."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

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
