"""AdamW parameter groups with layer-wise learning-rate decay for a network with a ViT backbone (Sapiens, BEiT)."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from lightning_memopt.models import VisionTransformer
from lightning_memopt.selection import WRAPPER_NAMES


def _unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def layer_decay_param_groups(
    network: nn.Module, lr: float, weight_decay: float, layer_decay: float
) -> list[dict[str, Any]]:
    """AdamW parameter groups with layer-wise learning-rate decay for a network with a ViT ``backbone``.

    As in the Sapiens / BEiT reference: with ``L`` blocks, a parameter at depth ``i`` gets
    ``lr · layer_decay^(L + 1 − i)``, where the patch embedding and the position table are depth 0,
    block ``k`` is depth ``k + 1`` and everything after the blocks (final norm, head) is depth
    ``L + 1``, at the full ``lr``. Biases, norm weights (every 1-D parameter) and the position table
    get no weight decay. Names inserted by FSDP, activation checkpointing or ``torch.compile``
    wrappers are ignored. Groups carry a ``name`` (``layer_<i>_decay`` / ``layer_<i>_no_decay``).

    Args:
        network: a module with a :class:`VisionTransformer` attribute ``backbone``.
        lr: the learning rate of the top layer.
        weight_decay: decoupled weight decay of the matrices.
        layer_decay: factor per layer of depth, in (0, 1].

    Example::

        >>> from lightning_memopt.models import create_model
        >>> groups = layer_decay_param_groups(create_model("sapiens_tiny"), lr=1.0, weight_decay=0.1, layer_decay=0.5)
        >>> [(g["name"], g["lr"], g["weight_decay"]) for g in groups][:3]
        [('layer_0_decay', 0.125, 0.1), ('layer_0_no_decay', 0.125, 0.0), ('layer_1_decay', 0.25, 0.1)]
    """
    backbone = cast(VisionTransformer, network.backbone)
    top = int(backbone.depth) + 1
    groups: dict[str, dict[str, Any]] = {}
    for raw_name, parameter in network.named_parameters():
        if not parameter.requires_grad:
            continue
        name = _unwrapped_name(raw_name)
        layer = backbone.layer_id(name.removeprefix("backbone.")) if name.startswith("backbone.") else top
        decay = parameter.ndim > 1 and not name.endswith("pos_embed")
        key = f"layer_{layer}_{'decay' if decay else 'no_decay'}"
        if key not in groups:
            groups[key] = {
                "name": key,
                "params": [],
                "lr": lr * layer_decay ** (top - layer),
                "weight_decay": weight_decay if decay else 0.0,
            }
        groups[key]["params"].append(parameter)
    return sorted(groups.values(), key=lambda group: (int(group["name"].split("_")[1]), group["name"]))
