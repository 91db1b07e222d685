"""Measured trials remembered between runs: a rerun, a resume or a multirun job of the same model, batch and device
measures nothing again.

The trials of :mod:`~lightning_memopt.planner.trials` are kept in ``measurements.json`` in the project's cache
folder (:func:`~lightning_memopt.planner.calibration.cache_folder`), under a key of what decides them: the model's
structure (each module's class, each parameter's and buffer's name, shape, dtype and whether it trains), the batch's
shapes and dtypes, the device's name and memory, the number of devices, and torch's and the project's versions. Each
candidate's knobs map to its measured step time and peak (or that it ran out of memory); whether a remembered peak
fits is decided again against the budget of the run that recalls it.

Example::

    >>> import tempfile, torch
    >>> from lightning_memopt.planner.trials import Measurement
    >>> memory = TrialMemory(Path(tempfile.mkdtemp()) / "measurements.json")
    >>> key = trial_key(torch.nn.Linear(4, 4), torch.randn(2, 4), torch.device("cpu"))
    >>> memory.remember(key, [Measurement(Knobs(), 0.1, 2048, 0.25, 1536, "measured")])
    >>> {knobs.describe(): kept for knobs, kept in memory.recall(key, [Knobs(), Knobs("bf16-mixed")]).items()}
    {'32-true': (0.25, 1536)}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memopt.__about__ import __version__
from lightning_memopt.planner.calibration import cache_folder, machine_key
from lightning_memopt.planner.knobs import Knobs
from lightning_memopt.planner.trials import MEASURED, OUT_OF_MEMORY, OVER_BUDGET, Measurement
from lightning_memopt.private_api import tree_flatten

_KEPT = (MEASURED, OVER_BUDGET, OUT_OF_MEMORY)  # an untried candidate is not remembered


def trial_key(model: nn.Module, batch: Any, device: torch.device, devices: int = 1) -> str:
    """What a trial's outcome depends on, hashed: the model's structure, the batch's shapes, the device and the
    versions (module docstring)."""
    parts: list[Any] = [torch.__version__, __version__, _device_name(device), devices]
    parts += [(name, type(module).__qualname__) for name, module in model.named_modules()]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts.append((name, tuple(tensor.shape), str(tensor.dtype), tensor.requires_grad))
    for leaf in tree_flatten(batch)[0]:
        parts.append((tuple(leaf.shape), str(leaf.dtype)) if isinstance(leaf, torch.Tensor) else type(leaf).__name__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {properties.total_memory} bytes"
    return f"{device.type}: {machine_key()}"


def _knobs_key(knobs: Knobs) -> str:
    return json.dumps(knobs.as_dict(), sort_keys=True)


class TrialMemory:
    """The measurements kept in ``path`` (default: ``measurements.json`` in the project's cache folder)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else cache_folder() / "measurements.json"

    def recall(self, key: str, knobs: Iterable[Knobs]) -> dict[Knobs, tuple[float | None, int | None]]:
        """The remembered step seconds and peak bytes (``None``: it ran out of memory) of ``knobs`` under ``key``
        (the ``remembered`` of :func:`~lightning_memopt.planner.trials.measure_candidates`)."""
        known = self._read().get(key, {})
        entries = {each: known.get(_knobs_key(each)) for each in knobs}
        return {
            each: (entry["measured_seconds"], entry["measured_peak_bytes"])
            for each, entry in entries.items()
            if entry is not None
        }

    def remember(self, key: str, measurements: Iterable[Measurement]) -> None:
        """Keep the measured trials (and those that ran out of memory) under ``key``; a read-only folder keeps
        nothing."""
        known = self._read()
        entries = known.setdefault(key, {})
        for measured in measurements:
            if measured.outcome in _KEPT:
                entries[_knobs_key(measured.knobs)] = {
                    "measured_seconds": measured.measured_seconds,
                    "measured_peak_bytes": measured.measured_peak_bytes,
                }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(known, indent=1, sort_keys=True))
        except OSError:
            pass

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: nothing remembered
            return {}
