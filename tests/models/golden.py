"""Golden outputs of the official implementations: draw an official state dict from a seed, compare, swap layers.

A fixture in ``tests/models/golden/<name>.json`` holds what the official code computed outside this repository
(its repository, commit, command and seed are recorded in the file; none of its code is here): the official state
dict's key names, shapes and dtypes in the official order, the seeds, and the outputs for a fixed input. A test
draws the same tensors in the same order (:func:`draw_official_state_dict`), converts them to our layout, runs our
model and compares. The generator outside the repository imports this module, so both sides draw identically.

    >>> tensors = [["conv.weight", [4, 2, 3, 3], "float32"], ["bn.running_var", [4], "float32"],
    ...            ["bn.num_batches_tracked", [], "int64"]]
    >>> drawn = draw_official_state_dict(tensors, seed=0)
    >>> [tuple(t.shape) for t in drawn.values()], bool((drawn["bn.running_var"] > 0).all())
    ([(4, 2, 3, 3), (4,), ()], True)
    >>> torch.equal(drawn["conv.weight"], draw_official_state_dict(tensors, seed=0)["conv.weight"])
    True
    >>> torch.equal(golden_tensor(stored_tensor(drawn["conv.weight"])), drawn["conv.weight"].double())  # round trip
    True
    >>> tensor_specs(drawn)[2]
    ['bn.num_batches_tracked', [], 'int64']
    >>> same_shaped_layer_pairs([["a.weight", [4, 4], "float32"], ["b.weight", [4, 4], "float32"],
    ...                          ["c.weight", [4, 2], "float32"]])
    [('a', 'b')]
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import torch
from torch import Tensor

GOLDEN_DIR = Path(__file__).with_name("golden")

# (key, shape, dtype name) in the official state dict's order, as a fixture stores them
TensorSpec = list  # [str, list[int], str]


def draw_tensor(key: str, shape: list[int], dtype: str, generator: torch.Generator) -> Tensor:
    """One tensor of a drawn state dict, scaled so that a deep network's activations stay finite.

    Integer tensors (``num_batches_tracked``) are zeros; running variances are uniform in [0.5, 1.5); running means,
    biases and other vectors are N(0, 0.1²) around 0, norm and PReLU scales (1-D ``weight``) around 1; tensors of two
    or more dimensions are N(0, 1/fan_in) with fan_in the product of all dimensions but the first.
    """
    torch_dtype = getattr(torch, dtype)
    if not torch_dtype.is_floating_point:
        return torch.zeros(shape, dtype=torch_dtype)
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    if key.endswith("running_var"):
        value = 0.5 + torch.rand(shape, generator=generator, dtype=torch.float64)
    elif len(shape) >= 2:
        value = noise / math.sqrt(max(1, math.prod(shape[1:])))
    elif key.endswith("weight"):
        value = 1.0 + 0.1 * noise
    else:
        value = 0.1 * noise
    return value.to(torch_dtype)


def draw_official_state_dict(tensors: list[TensorSpec], seed: int) -> dict[str, Tensor]:
    """The state dict a fixture's official run loaded: each tensor drawn in the listed order from one generator."""
    generator = torch.Generator().manual_seed(seed)
    return {key: draw_tensor(key, list(shape), dtype, generator) for key, shape, dtype in tensors}


def tensor_specs(state_dict: dict[str, Tensor]) -> list[TensorSpec]:
    """A state dict's keys, shapes and dtypes in its order, as a fixture stores them."""
    return [[key, list(value.shape), str(value.dtype).removeprefix("torch.")] for key, value in state_dict.items()]


def same_shaped_layer_pairs(tensors: list[TensorSpec]) -> list[tuple[str, str]]:
    """Every pair of layers (key prefixes before the last dot) whose tensors have the same names and shapes."""
    layers: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for key, shape, _ in tensors:
        layer, _, name = key.rpartition(".")
        layers[layer].append((name, tuple(shape)))
    by_signature: dict[tuple, list[str]] = defaultdict(list)
    for layer, signature in layers.items():
        by_signature[tuple(sorted(signature))].append(layer)
    return [pair for group in by_signature.values() for pair in combinations(group, 2)]


def swap_layers(state_dict: dict[str, Tensor], first: str, second: str) -> dict[str, Tensor]:
    """A copy of an (official) state dict with the tensors of layers ``first`` and ``second`` exchanged."""
    swapped = dict(state_dict)
    for key in state_dict:
        layer, _, name = key.rpartition(".")
        if layer == first:
            swapped[key], swapped[f"{second}.{name}"] = state_dict[f"{second}.{name}"], state_dict[key]
    return swapped


def load_golden(name: str) -> dict:
    """The fixture ``tests/models/golden/<name>.json``."""
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text())


def golden_tensor(entry: dict) -> Tensor:
    """An output a fixture stores as ``{"shape": [...], "values": [...]}`` (values flattened, row-major)."""
    return torch.tensor(entry["values"], dtype=torch.float64).reshape(entry["shape"])


def stored_tensor(tensor: Tensor) -> dict:
    """``tensor`` as a fixture stores it (see :func:`golden_tensor`)."""
    return {"shape": list(tensor.shape), "values": tensor.detach().double().flatten().tolist()}
