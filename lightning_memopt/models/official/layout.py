"""How an official state dict corresponds to one of our models, and the conversion both ways.

A layout names, for every tensor of our model, the official tensor(s) holding it (one, or several
whose rows are concatenated), converts values whose form differs (a resized position table), and
knows the official-only tensors: fixed buffers the official model computes (regenerated on export,
checked on import) and tensors that are legitimately not part of our model (a pre-training decoder,
a class token), each dropped with its reason. Anything else unmatched, on either side, is an error
that lists the keys: a conversion never silently loads half a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

# How many unmatched keys an error quotes per side (the counts are always given).
_QUOTED_KEYS = 12
# Wrappers the official training scripts and ours put around a state dict.
_CONTAINER_KEYS = ("state_dict", "model", "module")
_DDP_PREFIX = "module."


class OfficialCheckpointError(ValueError):
    """An official state dict does not match the model: keys on either side that nothing places."""


@dataclass(frozen=True)
class Rename:
    """One rename rule ``ours → official`` over dotted names, e.g. ``Rename(r"stages\\.(\\d+)\\.", ...)``.

    Args:
        pattern: a regular expression matched against our name (``re.sub``, every match).
        replacement: the official text, or a function of the match.

    Example::

        >>> Rename(r"^blocks\\.", "layers.").apply("blocks.3.norm1.weight")
        'layers.3.norm1.weight'
        >>> Rename(r"stages\\.(\\d+)\\.", lambda m: f"layer{int(m[1]) + 1}.").apply("fnet.stages.0.1.conv1.weight")
        'fnet.layer1.1.conv1.weight'
    """

    pattern: str
    replacement: str | Callable[[re.Match[str]], str]

    def apply(self, name: str) -> str:
        return re.sub(self.pattern, self.replacement, name)


def renamed(name: str, rules: Sequence[Rename]) -> str:
    """``name`` after every rule of ``rules`` in order.

    Example::

        >>> renamed("head.predict.weight", [Rename(r"^head\\.", "decode_head."), Rename(r"predict", "conv_seg")])
        'decode_head.conv_seg.weight'
    """
    for rule in rules:
        name = rule.apply(name)
    return name


class OfficialLayout:
    """The official layout of one model; subclasses override the hooks their family needs.

    Args:
        model: the model (any device, ``meta`` included) whose state dict is the template.
        backbone_only: the official file holds the backbone alone (e.g. an MAE pre-training
            checkpoint): the template is the tensors under :attr:`backbone_prefix`.

    Raises:
        OfficialCheckpointError: ``backbone_only`` for a family without a separate backbone.
    """

    #: what the layout is called in messages and in the docs' conversion table
    family = "identical"
    #: rename rules ours → official, applied in order
    rules: Sequence[Rename] = ()
    #: prefix of the backbone's tensors in our model, for families released as backbone-only files too
    backbone_prefix: str | None = None

    def __init__(self, model: nn.Module, backbone_only: bool = False) -> None:
        if backbone_only and self.backbone_prefix is None:
            raise OfficialCheckpointError(
                f"`backbone_only`=True, but {self.family} checkpoints come whole (no backbone-only files); "
                "load it with `pretrained` instead"
            )
        self.model = model
        self.backbone_only = backbone_only

    def template(self) -> dict[str, Tensor]:
        """Our tensors the official file holds: the model's state dict, or its backbone's part of it."""
        state = self.model.state_dict()
        if not self.backbone_only:
            return state
        return {name: value for name, value in state.items() if name.startswith(str(self.backbone_prefix))}

    def prepare_official(self, official: dict[str, Tensor]) -> dict[str, Tensor]:
        """The official tensors as the rename rules expect them (e.g. a missing ``backbone.`` prefix added)."""
        return official

    def official_names(self, name: str, template: Tensor) -> tuple[str, ...]:
        """The official tensor(s) holding our tensor ``name``; several are concatenated along dim 0."""
        return (renamed(name, self.rules),)

    def official_rows(self, name: str, template: Tensor) -> tuple[int, ...]:
        """Rows of each official piece of ``name`` when :meth:`official_names` gives several."""
        return (template.shape[0],)

    def to_ours(self, name: str, value: Tensor, template: Tensor) -> Tensor:
        """Our value of ``name`` from the (concatenated) official value; the default keeps it."""
        return value

    def to_official(self, name: str, value: Tensor) -> Tensor:
        """The official value of our tensor ``name``; the default keeps it."""
        return value

    def accepts(self, name: str, value: Tensor, template: Tensor) -> bool:
        """Whether a converted ``value`` can load into ``template``; the default asks for the same shape."""
        return value.shape == template.shape

    def mismatch(self, name: str, value: Tensor, template: Tensor) -> str:
        """How the error describes a ``value`` that :meth:`accepts` refused; the default gives both shapes."""
        return f"{name} {tuple(value.shape)} (model {tuple(template.shape)})"

    def fixed_tensors(self) -> dict[str, Tensor]:
        """Official-only tensors the official model computes (buffers): written on export, checked on import."""
        return {}

    def dropped_reason(self, official_name: str) -> str | None:
        """Why an official-only tensor is not part of our model (dropped on import), or None if it should be."""
        return None

    def load_notes(self, model: nn.Module, state_dict: Mapping[str, Tensor]) -> list[str]:
        """What loading ``state_dict`` changes in ``model`` beyond its values, as lines for the log."""
        return []


@dataclass
class ConversionReport:
    """What a conversion did: counts for the docs' conversion table and lines for the log."""

    family: str
    tensors: int = 0
    renamed: list[str] = field(default_factory=list)
    reshaped: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    checked_fixed: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    not_loaded: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line, e.g. ``"CoTracker3 layout: 185 tensors (145 renamed, 0 reshaped, 2 merged from several); …"``."""
        parts = [f"{self.tensors} tensors ({len(self.renamed)} renamed, {len(self.reshaped)} reshaped"]
        if self.merged:
            parts[0] += f", {len(self.merged)} merged from several"
        parts[0] += ")"
        if self.checked_fixed:
            parts.append(f"{len(self.checked_fixed)} fixed buffers checked ({', '.join(self.checked_fixed)})")
        reasons: dict[str, list[str]] = {}
        for key, reason in self.dropped.items():
            reasons.setdefault(reason, []).append(key)
        parts.extend(f"dropped {len(keys)} ({reason})" for reason, keys in reasons.items())
        if self.not_loaded:
            parts.append(f"NOT LOADED (strict=False): {len(self.not_loaded)} mismatches: {_quoted(self.not_loaded)}")
        return f"{self.family} layout: " + "; ".join(parts)


def unwrap_state_dict(checkpoint: Mapping[str, object]) -> dict[str, Tensor]:
    """The tensors of an official file: unwraps ``{"state_dict" | "model" | "module": …}`` and strips ``module.``.

    Raises:
        OfficialCheckpointError: when no mapping of tensors is found.

    Example::

        >>> sorted(unwrap_state_dict({"state_dict": {"module.fc.weight": torch.zeros(1)}, "epoch": 3}))
        ['fc.weight']
    """
    current: object = checkpoint
    while isinstance(current, Mapping) and not _all_tensors(current):
        inner = next((current[key] for key in _CONTAINER_KEYS if isinstance(current.get(key), Mapping)), None)
        if inner is None:
            found = ", ".join(repr(key) for key in list(current)[:10])
            raise OfficialCheckpointError(
                f"no state dict found: the file holds {found}; expected tensors, or one of "
                f"{', '.join(repr(key) for key in _CONTAINER_KEYS)} holding them"
            )
        current = inner
    if not isinstance(current, Mapping):
        raise OfficialCheckpointError(f"no state dict found: the file holds a {type(current).__name__}")
    tensors = {str(key): value for key, value in current.items()}
    while tensors and all(key.startswith(_DDP_PREFIX) for key in tensors):
        tensors = {key[len(_DDP_PREFIX) :]: value for key, value in tensors.items()}
    return tensors


def _all_tensors(mapping: Mapping[str, object]) -> bool:
    return bool(mapping) and all(isinstance(value, Tensor) for value in mapping.values())


def _quoted(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_QUOTED_KEYS])
    return shown + (f", … ({len(keys) - _QUOTED_KEYS} more)" if len(keys) > _QUOTED_KEYS else "")


def _mismatch_error(family: str, missing: list[str], unplaced: list[str], bad_shapes: list[str]) -> str:
    lines = [f"the checkpoint does not match the {family} layout of the model:"]
    if missing:
        lines.append(f"  model tensors with no official counterpart in the file ({len(missing)}): {_quoted(missing)}")
    if unplaced:
        lines.append(f"  official tensors that nothing in the model takes ({len(unplaced)}): {_quoted(unplaced)}")
    if bad_shapes:
        lines.append(f"  tensors whose shapes differ ({len(bad_shapes)}): {_quoted(bad_shapes)}")
    lines.append("  (is it the checkpoint of another preset, or a backbone-only file? see `pretrained_backbone`)")
    return "\n".join(lines)


def _fixed_tensor_difference(official: Tensor, expected: Tensor) -> str | None:
    """How an official fixed buffer differs from the model's own (its shape, or its largest difference), or None.

    Values are compared in the file's dtype, within a few of its units in the last place: a half-precision copy of
    a checkpoint passes, a table made for another configuration does not.
    """
    if official.shape != expected.shape:
        return f"its shape {tuple(official.shape)} is not the model's {tuple(expected.shape)}"
    if official.is_meta or expected.is_meta:
        return None
    dtype = official.dtype
    tolerance = max(1e-5, 2 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0
    official, expected = official.float().cpu(), expected.to(dtype).float().cpu()
    largest = float((official - expected).abs().max()) if official.numel() else 0.0
    return None if largest <= tolerance else f"its values differ by up to {largest:.3g} ({dtype})"


def convert_to_ours(
    official: Mapping[str, Tensor], layout: OfficialLayout, strict: bool = True
) -> tuple[dict[str, Tensor], ConversionReport]:
    """Our state dict from an official one (already unwrapped), with the report.

    With ``strict=False`` the tensors that match are converted and every mismatch is listed in
    ``report.not_loaded`` instead of raising (a differing fixed buffer still raises).

    Raises:
        OfficialCheckpointError: listing our tensors with no official counterpart, official tensors that
            nothing takes, shape mismatches, or a fixed buffer that differs from the model's configuration.
    """
    template = layout.template()
    official = layout.prepare_official(dict(official))
    report = ConversionReport(layout.family)
    converted: dict[str, Tensor] = {}
    consumed: set[str] = set()
    missing: list[str] = []
    bad_shapes: list[str] = []
    for name, template_value in template.items():
        sources = layout.official_names(name, template_value)
        if any(source not in official for source in sources):
            missing.append(name)
            continue
        consumed.update(sources)
        pieces = [official[source] for source in sources]
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        value = layout.to_ours(name, joined, template_value)
        if not layout.accepts(name, value, template_value):
            bad_shapes.append(layout.mismatch(name, value, template_value))
            continue
        converted[name] = value
        report.tensors += 1
        if sources != (name,):
            (report.merged if len(sources) > 1 else report.renamed).append(name)
        if value is not joined:
            report.reshaped.append(name)
    fixed = layout.fixed_tensors()
    unplaced: list[str] = []
    for name in sorted(set(official) - consumed):
        if name in fixed:
            if (difference := _fixed_tensor_difference(official[name], fixed[name])) is not None:
                raise OfficialCheckpointError(
                    f"the official buffer `{name}` is not what the model computes: {difference}; the checkpoint "
                    "was made for another configuration (window length, model resolution or stride)"
                )
            report.checked_fixed.append(name)
        elif (reason := layout.dropped_reason(name)) is not None:
            report.dropped[name] = reason
        else:
            unplaced.append(name)
    if strict and (missing or unplaced or bad_shapes):
        raise OfficialCheckpointError(_mismatch_error(layout.family, missing, unplaced, bad_shapes))
    report.not_loaded = [*(f"missing {key}" for key in missing), *(f"unplaced {key}" for key in unplaced), *bad_shapes]
    return converted, report


def convert_to_official(ours: Mapping[str, Tensor], layout: OfficialLayout) -> dict[str, Tensor]:
    """The official state dict of our state dict ``ours`` (complete: fixed buffers included).

    Raises:
        OfficialCheckpointError: when ``ours`` lacks tensors of the model or holds tensors it does not have.
    """
    template = layout.template()
    missing = sorted(set(template) - set(ours))
    extra = sorted(set(ours) - set(template))
    if missing or extra:
        raise OfficialCheckpointError(_mismatch_error(layout.family, missing, extra, []))
    result: dict[str, Tensor] = {}
    for name, template_value in template.items():
        value = layout.to_official(name, ours[name])
        sources = layout.official_names(name, template_value)
        if len(sources) == 1:
            result[sources[0]] = value
            continue
        for source, piece in zip(sources, value.split(list(layout.official_rows(name, template_value))), strict=True):
            result[source] = piece.clone()
    result.update(layout.fixed_tensors())
    return result
