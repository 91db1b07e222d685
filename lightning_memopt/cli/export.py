"""``memopt-export``: write a trained network back in its official layout, for the official demo and eval code.

Examples (shell)::

    memopt-export outputs/run/checkpoints/last.ckpt sapiens_1b_normal.pth     # preset from the checkpoint
    memopt-export my_weights.pth cotracker3.pth --model cotracker3           # a bare state dict of ours
    memopt-export outputs/run/checkpoints/last.ckpt/ sapiens_2b_normal.pth    # fsdp_memopt's sharded folder

The input is a Lightning checkpoint written by ``memopt-train`` (a file, or fsdp_memopt's folder of
shards; the preset and its options are read from its hyper-parameters) or a bare state dict of one
of our presets (``--model`` names it). The output is a bare official state dict (``torch.load`` +
``load_state_dict`` in the official code).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_memopt.cli.errors import input_errors

# torch is imported once an export starts, not with this module: `memopt-export --help` answers at once.
if TYPE_CHECKING:
    from torch import Tensor


def _unwrapped(name: str, wrapper_names: Collection[str]) -> str:
    return ".".join(part for part in name.split(".") if part not in wrapper_names)


def network_state_dict(state_dict: Mapping[str, Tensor], template: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of a network inside a task's state dict: the prefix (``backbone.``, ``network.``…) is found.

    Raises:
        OfficialCheckpointError: when no prefix holds every tensor of ``template``.

    Example::

        >>> import torch
        >>> template = {"fc.weight": torch.zeros(1), "fc.bias": torch.zeros(1)}
        >>> task = {"backbone.fc.weight": torch.ones(1), "backbone.fc.bias": torch.ones(1), "head.w": torch.ones(1)}
        >>> sorted(network_state_dict(task, template))
        ['fc.bias', 'fc.weight']
    """
    from lightning_memopt.models.official import OfficialCheckpointError
    from lightning_memopt.selection import WRAPPER_NAMES

    tensors = {_unwrapped(name, WRAPPER_NAMES): value for name, value in state_dict.items()}
    first = next(iter(template))
    prefixes = [name[: -len(first)] for name in tensors if name.endswith(first)]
    for prefix in prefixes:
        if all(prefix + name in tensors for name in template):
            return {name: tensors[prefix + name] for name in template}
    missing = [name for name in template if not any(prefix + name in tensors for prefix in prefixes or [""])]
    raise OfficialCheckpointError(
        f"the checkpoint does not hold the network: {len(missing)} of its {len(template)} tensors are missing "
        f"(first: {', '.join(missing[:5])})"
    )


def export_official(
    checkpoint: Mapping[str, Any], model: str | None = None, **preset_overrides: Any
) -> tuple[dict[str, Tensor], str]:
    """The official state dict of the network in ``checkpoint``, and the name of its layout's family.

    Args:
        checkpoint: a Lightning checkpoint of one of our tasks (its ``hyper_parameters`` name the
            preset and its options), or a bare state dict of a preset.
        model: the preset; required for a bare state dict, otherwise it overrides the checkpoint's.
        **preset_overrides: constructor overrides of the preset (on top of the checkpoint's options).

    Raises:
        OfficialCheckpointError: for an unknown preset, a preset without an official layout, or a
            checkpoint that does not hold the network.
    """
    import torch

    from lightning_memopt.models.official import OfficialCheckpointError, official_layout
    from lightning_memopt.models.official.layout import convert_to_official
    from lightning_memopt.models.registry import create_model

    hyper_parameters = checkpoint.get("hyper_parameters", {})
    name = model or hyper_parameters.get("backbone")
    if name is None:
        raise OfficialCheckpointError(
            "the checkpoint does not name its preset (no `hyper_parameters.backbone`): pass `--model NAME`"
        )
    options = {**dict(hyper_parameters.get("backbone_options") or {}), **preset_overrides}
    with torch.device("meta"):
        network = create_model(name, **options)
    state_dict = checkpoint.get("state_dict", checkpoint)
    ours = network_state_dict(state_dict, network.state_dict())
    layout = official_layout(network)
    return convert_to_official(ours, layout), layout.family


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; a bad input ends with its reason on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog="memopt-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a memopt-train checkpoint (.ckpt) or a state dict of ours")
    parser.add_argument("output", type=Path, help="where to write the official state dict")
    parser.add_argument("--model", help="the preset (default: the checkpoint's `backbone`)")
    args = parser.parse_args(argv)
    import torch

    from lightning_memopt.strategies.consolidate import check_checkpoint, consolidate_checkpoint, is_sharded_checkpoint

    with input_errors("memopt-export", building=True):
        check_checkpoint("checkpoint", args.checkpoint)
        if is_sharded_checkpoint(args.checkpoint):  # fsdp_memopt's folder of shards
            checkpoint = consolidate_checkpoint(args.checkpoint)
        else:
            # A training checkpoint of your own: Lightning stores callback states and hyper-parameters beside tensors.
            checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        official, family = export_official(checkpoint, args.model)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(official, args.output)
    print(f"memopt-export: wrote {args.output}: {len(official)} tensors in the official {family} layout")


if __name__ == "__main__":
    main()
