"""Official checkpoints in and out: the released IResNet, Sapiens and CoTracker weights load into our presets.

``convert_official_state_dict`` maps an official state dict to ours, ``to_official_state_dict`` maps
back (bitwise: official → ours → official returns the same tensors), and ``load_pretrained`` reads a
file into a model, logging what it did. Which layout applies is decided by the model's class.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_memopt.models.cotracker import CoTracker2, CoTracker3
from lightning_memopt.models.iresnet import IResNet
from lightning_memopt.models.official.cotracker import CoTracker2Layout, CoTracker3Layout
from lightning_memopt.models.official.layout import (
    ConversionReport,
    OfficialCheckpointError,
    OfficialLayout,
    convert_to_official,
    convert_to_ours,
    unwrap_state_dict,
)
from lightning_memopt.models.official.sapiens import SapiensLayout
from lightning_memopt.models.registry import create_model
from lightning_memopt.models.sapiens import SapiensNormal

__all__ = [
    "ConversionReport",
    "OfficialCheckpointError",
    "OfficialLayout",
    "apply_pretrained",
    "convert_official_state_dict",
    "load_pretrained",
    "official_layout",
    "read_official_file",
    "to_official_state_dict",
]


class IResNetLayout(OfficialLayout):
    """insightface ``arcface_torch`` IResNet: the same key names and shapes as ours."""

    family = "IResNet"


# Most specific classes first: a layout applies to its class and subclasses.
_LAYOUTS: tuple[tuple[type[nn.Module], type[OfficialLayout]], ...] = (
    (IResNet, IResNetLayout),
    (SapiensNormal, SapiensLayout),
    (CoTracker2, CoTracker2Layout),
    (CoTracker3, CoTracker3Layout),  # the offline CoTracker3 too
)


def official_layout(model: nn.Module, backbone_only: bool = False) -> OfficialLayout:
    """The official layout of ``model`` (an IResNet, Sapiens or CoTracker preset).

    ``backbone_only`` selects the layout of a file holding the backbone alone (Sapiens MAE pre-training).

    Raises:
        OfficialCheckpointError: for a model with no official layout, naming the supported classes.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> official_layout(create_model("iresnet_tiny")).family
        'IResNet'
    """
    for model_class, layout_class in _LAYOUTS:
        if isinstance(model, model_class):
            return layout_class(model, backbone_only)
    supported = ", ".join(model_class.__name__ for model_class, _ in _LAYOUTS)
    raise OfficialCheckpointError(
        f"no official layout for a {type(model).__name__}; official checkpoints exist for: {supported}"
    )


def _preset(name: str, overrides: Mapping[str, Any]) -> nn.Module:
    with torch.device("meta"):
        return create_model(name, **overrides)


def convert_official_state_dict(state_dict: Mapping[str, Any], name: str, **preset_overrides: Any) -> dict[str, Tensor]:
    """Our state dict for preset ``name`` from an official one (a file's content: containers are unwrapped).

    Args:
        state_dict: the official tensors, bare or in ``{"state_dict": …}`` / ``{"model": …}``, keys
            with or without ``module.``.
        name: the preset (``"r50"``, ``"sapiens_1b"``, ``"cotracker3"``, …).
        **preset_overrides: the preset's constructor overrides the checkpoint was made for
            (``window_len``, ``model_resolution``, ``image_size`` …).

    Raises:
        OfficialCheckpointError: listing the keys that do not match, on both sides.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> official = {"module." + key: value for key, value in create_model("iresnet_tiny").state_dict().items()}
        >>> ours = convert_official_state_dict({"state_dict": official}, "iresnet_tiny")
        >>> sorted(ours)[:2]
        ['bn1.bias', 'bn1.num_batches_tracked']
    """
    converted, _ = convert_to_ours(unwrap_state_dict(state_dict), official_layout(_preset(name, preset_overrides)))
    return converted


def to_official_state_dict(state_dict: Mapping[str, Tensor], name: str, **preset_overrides: Any) -> dict[str, Tensor]:
    """The official state dict of our state dict of preset ``name``; inverse of :func:`convert_official_state_dict`.

    Raises:
        OfficialCheckpointError: when ``state_dict`` is not a complete state dict of the preset.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> ours = create_model("iresnet_tiny").state_dict()
        >>> official = to_official_state_dict(ours, "iresnet_tiny")
        >>> all(torch.equal(official[key], value) for key, value in ours.items())
        True
    """
    return convert_to_official(state_dict, official_layout(_preset(name, preset_overrides)))


def read_official_file(path: str | Path, weights_only: bool = True) -> dict[str, Tensor]:
    """The tensors of an official checkpoint file (containers unwrapped, ``module.`` stripped).

    Args:
        path: a ``.pth`` / ``.pt`` / ``.ckpt`` file.
        weights_only: load with ``torch.load(weights_only=True)``; files that pickle other objects
            (some training scripts save their config) need ``False``, for a file you trust.

    Raises:
        FileNotFoundError: the file does not exist.
        OfficialCheckpointError: the file holds no state dict, or objects ``weights_only`` refuses.
    """
    path = Path(path)
    if path.is_dir():
        raise OfficialCheckpointError(
            f"{str(path)!r} is a directory (a sharded checkpoint?): give the file of a whole state dict"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {str(path)!r} does not exist")
    try:
        content = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        reason = _refusal(error)
        if "Unsupported global" not in reason:
            raise OfficialCheckpointError(f"{str(path)!r} is not a checkpoint torch.load reads ({reason})") from error
        raise OfficialCheckpointError(
            f"{str(path)!r} holds objects besides tensors, which `weights_only=True` refuses to unpickle "
            f"({reason}); if you trust the file, load it with `weights_only=False`"
        ) from error
    except (RuntimeError, EOFError, KeyError, ValueError) as error:
        raise OfficialCheckpointError(f"{str(path)!r} is not a checkpoint torch.load reads ({error!r})") from error
    if not isinstance(content, Mapping):
        raise OfficialCheckpointError(f"{str(path)!r} holds a {type(content).__name__}, not a state dict")
    return unwrap_state_dict(content)


def _refusal(error: pickle.UnpicklingError) -> str:
    """The line of torch's refusal that says what it refused (``Unsupported global: …``), without colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    found = re.search(r"Unsupported[^\n]*?(?=\. Please|\n|$)", text)
    return found.group(0) if found else text.splitlines()[0] if text else "refused"


def load_pretrained(
    model: nn.Module,
    path: str | Path,
    strict: bool = True,
    backbone_only: bool = False,
    weights_only: bool = True,
) -> ConversionReport:
    """Load an official checkpoint file into ``model`` (converted to our layout), and log what was loaded.

    Args:
        model: an IResNet, Sapiens or CoTracker preset.
        path: the official file.
        backbone_only: the file holds the backbone alone (a Sapiens MAE pre-training checkpoint); the
            rest of the model (the head) keeps its initialisation.
        strict: every tensor must match (the default). ``False`` loads what matches and warns with
            every key that did not; nothing is skipped without being named.
        weights_only: see :func:`read_official_file`.

    Returns:
        The conversion report (also logged).

    Raises:
        OfficialCheckpointError: with ``strict=True``, listing the keys that do not match on both sides.

    Example::

        >>> import tempfile, os
        >>> from lightning_memopt.models import create_model
        >>> path = os.path.join(tempfile.mkdtemp(), "backbone.pth")
        >>> torch.save(create_model("iresnet_tiny").state_dict(), path)
        >>> load_pretrained(create_model("iresnet_tiny"), path).tensors
        115
    """
    if any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
        raise OfficialCheckpointError(
            "the model is on the meta device, where loading copies nothing: materialise it first "
            "(`model.to_empty(device=...)`), or convert the file with `convert_official_state_dict`"
        )
    layout = official_layout(model, backbone_only)
    converted, report = convert_to_ours(read_official_file(path, weights_only), layout, strict=strict)
    notes = layout.load_notes(model, converted)
    # Non-strict at the module level only for the tensors outside the template (the head of a backbone-only
    # load): the conversion has already checked every tensor of the template.
    model.load_state_dict(converted, strict=strict and not backbone_only)
    message = f"loaded {path}: {report.summary()}" + "".join(f"; {line}" for line in notes)
    if report.not_loaded:
        rank_zero_warn(message)
    else:
        rank_zero_info(message)
    return report


def apply_pretrained(
    model: nn.Module,
    pretrained: str | Path | None = None,
    pretrained_backbone: str | Path | None = None,
    weights_only: bool = True,
) -> ConversionReport | None:
    """Load the official file a task was configured with (``model.pretrained=`` / ``model.pretrained_backbone=``).

    Args:
        model: the task's network.
        pretrained: a whole-model official checkpoint, or None.
        pretrained_backbone: a backbone-only official checkpoint (Sapiens MAE pre-training), or None.
        weights_only: see :func:`read_official_file`.

    Returns:
        The conversion report, or None when neither file is given.

    Raises:
        OfficialCheckpointError: when both are given (a whole-model file already holds the backbone), and
            see :func:`load_pretrained`.

    Example::

        >>> from lightning_memopt.models import create_model
        >>> apply_pretrained(create_model("iresnet_tiny")) is None
        True
    """
    if pretrained is not None and pretrained_backbone is not None:
        raise OfficialCheckpointError(
            f"give `pretrained`={str(pretrained)!r} or `pretrained_backbone`={str(pretrained_backbone)!r}, not both: "
            "the whole-model file already holds the backbone"
        )
    if pretrained is not None:
        return load_pretrained(model, pretrained, weights_only=weights_only)
    if pretrained_backbone is not None:
        return load_pretrained(model, pretrained_backbone, backbone_only=True, weights_only=weights_only)
    return None
