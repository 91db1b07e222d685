"""TopoFR's topological alignment loss: minimum-spanning-tree edges of two distance matrices, in O(B²) memory.

TopoFR's structure-damage score (:func:`hard_sample_probability`) says how likely a sample is hard, from a
Gaussian–uniform fit of the predictions' entropies.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

VARIANTS = ("diagram", "symmetric")
TopologyVariant = Literal["diagram", "symmetric"]  # == VARIANTS
_TINY = 1e-30  # keeps sqrt's gradient finite where a squared distance is (nearly) zero


def pairwise_distances(points: Tensor) -> Tensor:
    """``[B, B]`` Euclidean distances between the rows of ``points`` (``[B, ...]``, flattened), at least fp32.

    Without gradient the distances are direct sums of squared differences (``torch.cdist``'s
    non-matrix mode: exact for equal points, no ``B × B × D`` buffer). With gradient they come from
    the Gram identity ``‖a‖² + ‖b‖² − 2 a·b`` on mean-centred rows in fp64 (no cancellation, no
    TF32; cheap for ``B × d`` embeddings), whose backward is two matrix products; the square
    root's gradient is zero, not NaN, where two points coincide.

    Example::

        >>> pairwise_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]])).tolist()
        [[0.0, 5.0], [5.0, 0.0]]
    """
    flat = _at_least_fp32(points.reshape(points.shape[0], -1))
    if not flat.requires_grad:
        return torch.cdist(flat[None], flat[None], compute_mode="donot_use_mm_for_euclid_dist")[0]
    wide = flat.double()  # fp64: no cancellation in ‖a‖² + ‖b‖² − 2a·b, and no TF32 matmul
    centred = wide - wide.mean(dim=0, keepdim=True).detach()
    squared_norms = centred.pow(2).sum(dim=1)
    squared = (squared_norms[:, None] + squared_norms[None, :] - 2 * centred @ centred.T).clamp_min(0)
    squared = squared * (1 - torch.eye(flat.shape[0], device=flat.device, dtype=wide.dtype))  # exact zero diagonal
    positive = squared > 0
    distances = torch.where(positive, squared.clamp_min(_TINY).sqrt(), torch.zeros_like(squared))
    return distances.to(flat.dtype)


def minimum_spanning_tree(distances: Tensor) -> Tensor:
    """The ``B − 1`` edges ``[B − 1, 2]`` (``i < j``) of the minimum spanning tree of a ``[B, B]`` distance matrix.

    The matrix must be symmetric (as distances are); infinite distances are allowed.

    These are the persistence pairs of 0-dimensional Vietoris–Rips persistent homology: each edge
    kills one connected component at its length. Prim's algorithm on the matrix's device, with
    no transfer to the host: ``B − 1`` rounds of vector operations. Edges are ordered by
    ``(length, i, j)``, and ties follow that order too, so the tree is the one Kruskal's algorithm
    finds over edges sorted by ``(length, i, j)``; edges come out in that (Kruskal) order.

    Raises:
        ValueError: for a matrix that is not square ``[B, B]`` with ``B`` ≥ 2.

    Example::

        >>> points = torch.tensor([[0.0], [1.0], [3.0], [3.5]])
        >>> minimum_spanning_tree(pairwise_distances(points)).tolist()
        [[2, 3], [0, 1], [1, 2]]
    """
    if distances.dim() != 2 or distances.shape[0] != distances.shape[1] or distances.shape[0] < 2:
        raise ValueError(f"`distances` {list(distances.shape)} must be a square [B, B] matrix with B ≥ 2")
    distances = distances.detach()
    size, device = distances.shape[0], distances.device
    vertices = torch.arange(size, device=device)
    in_tree = vertices == 0
    best = distances[0].clone()  # the shortest edge from the tree to each vertex
    best_from = torch.zeros(size, dtype=torch.long, device=device)  # and its end in the tree
    edges = torch.empty(size - 1, 2, dtype=torch.long, device=device)
    for step in range(size - 1):
        key = _edge_key(best_from, vertices, size)
        candidate = torch.where(in_tree, torch.inf, best)
        shortest = candidate.min()
        # the lowest (i, j) among equals; kept a one-element tensor: indexing with it never reads it on the host
        chosen = torch.where((candidate == shortest) & ~in_tree, key, size * size).argmin().reshape(1)
        edges[step] = torch.sort(torch.cat([best_from.index_select(0, chosen), chosen])).values
        in_tree = in_tree | (vertices == chosen)
        row = distances.index_select(0, chosen)[0]
        new_key = _edge_key(chosen.expand(size), vertices, size)
        closer = (row < best) | ((row == best) & (new_key < key))
        best = torch.where(closer, row, best)
        best_from = torch.where(closer, chosen.expand(size), best_from)
    lengths = distances[edges[:, 0], edges[:, 1]]
    order = _lexicographic_order(lengths, edges[:, 0] * size + edges[:, 1])
    return edges[order]


def _at_least_fp32(tensor: Tensor) -> Tensor:
    """Half precision raised to fp32; fp32 and fp64 kept (fp64 for gradient checks)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _edge_key(first: Tensor, second: Tensor, size: int) -> Tensor:
    """``min · B + max`` of each pair: the order among edges of equal length."""
    return torch.minimum(first, second) * size + torch.maximum(first, second)


def _lexicographic_order(lengths: Tensor, keys: Tensor) -> Tensor:
    """The permutation sorting by ``lengths``, then ``keys``: two stable sorts."""
    by_key = torch.argsort(keys, stable=True)
    return by_key[torch.argsort(lengths[by_key], stable=True)]


def topological_alignment_loss(
    input_distances: Tensor, latent_distances: Tensor, variant: TopologyVariant = "diagram"
) -> Tensor:
    """The signature loss between two ``[B, B]`` distance matrices, divided by ``B``.

    - ``"symmetric"`` (Moor et al.): ``½‖A_X[π_X] − A_Z[π_X]‖² + ½‖A_Z[π_Z] − A_X[π_Z]‖²``, where
      ``π`` is a space's minimum-spanning-tree edges and ``A`` its distances.
    - ``"diagram"`` (TopoFR's default): ``‖A_X[π_X] − A_Z[π_Z]‖²``, the two trees' edge lengths
      each in ascending (Kruskal) order, i.e. the 0-dimensional persistence diagrams' death times
      matched in order.

    Only ``latent_distances`` receives a gradient; ``input_distances`` is treated as a target.

    Raises:
        ValueError: for an unknown ``variant``, or matrices that are not both ``[B, B]`` with ``B`` ≥ 2.

    Example::

        >>> x = pairwise_distances(torch.tensor([[0.0], [1.0], [3.0]]))
        >>> float(topological_alignment_loss(x, 2 * x))  # (1² + 2²) / 3 for each space's tree
        1.6666666269302368
    """
    if variant not in VARIANTS:
        raise ValueError(f"Unknown `variant`={variant!r}; valid choices: {', '.join(VARIANTS)}")
    if input_distances.shape != latent_distances.shape:
        raise ValueError(
            f"`input_distances` {list(input_distances.shape)} and `latent_distances` "
            f"{list(latent_distances.shape)} must describe the same batch"
        )
    size = input_distances.shape[0]
    target = _at_least_fp32(input_distances.detach())
    latent = _at_least_fp32(latent_distances)
    input_edges = minimum_spanning_tree(target)
    latent_edges = minimum_spanning_tree(latent)
    input_rows, input_cols = input_edges[:, 0], input_edges[:, 1]
    latent_rows, latent_cols = latent_edges[:, 0], latent_edges[:, 1]
    if variant == "diagram":
        difference = target[input_rows, input_cols] - latent[latent_rows, latent_cols]
        return difference.pow(2).sum() / size
    input_side = (target[input_rows, input_cols] - latent[input_rows, input_cols]).pow(2).sum()
    latent_side = (latent[latent_rows, latent_cols] - target[latent_rows, latent_cols]).pow(2).sum()
    return 0.5 * (input_side + latent_side) / size


class TopologicalAlignmentLoss(nn.Module):
    """TopoFR's topological structure alignment between a batch's inputs and its embeddings.

    Both pairwise distance matrices are ``B × B`` (never ``B × B × D``), computed in fp32 with
    autocast off, and both minimum spanning trees are built on the batch's device. The loss is
    part of the ordinary graph: one ``backward`` frees it, no ``retain_graph``.

    Args:
        variant: ``"diagram"`` (TopoFR's default) or ``"symmetric"`` (Moor et al.); see
            :func:`topological_alignment_loss`.

    Raises:
        ValueError: for an unknown ``variant``; in ``forward``, for batches of different sizes or
            ``B`` < 2.

    Example::

        >>> loss = TopologicalAlignmentLoss()
        >>> images, embeddings = torch.randn(8, 3, 16, 16), torch.randn(8, 32, requires_grad=True)
        >>> value = loss(images, embeddings)
        >>> value.backward()
        >>> embeddings.grad.shape
        torch.Size([8, 32])
    """

    def __init__(self, variant: TopologyVariant = "diagram") -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"Unknown `variant`={variant!r}; valid choices: {', '.join(VARIANTS)}")
        self.variant = variant

    def forward(self, inputs: Tensor, embeddings: Tensor) -> Tensor:
        """The loss of ``inputs`` ``[B, ...]`` (the input space) against ``embeddings`` ``[B, ...]`` (latent)."""
        if inputs.shape[0] != embeddings.shape[0] or inputs.shape[0] < 2:
            raise ValueError(
                f"`inputs` {list(inputs.shape)} and `embeddings` {list(embeddings.shape)} must share a batch "
                "size B ≥ 2 (a spanning tree needs two points)"
            )
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            input_distances = pairwise_distances(inputs.detach())
            latent_distances = pairwise_distances(embeddings)
            return topological_alignment_loss(input_distances, latent_distances, self.variant)

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}"


_EPS = 1e-6
_RELATIVE_FLOOR = 1e-3  # the Gaussian's standard deviation is at least this share of the values' range


def prediction_entropy(logits: Tensor) -> Tensor:
    """``[B]`` Shannon entropy (nats) of each row's softmax, in fp32, without gradient.

    Example::

        >>> [round(value, 4) for value in prediction_entropy(torch.tensor([[0.0, 0.0], [100.0, 0.0]])).tolist()]
        [0.6931, 0.0]
    """
    log_probabilities = torch.log_softmax(logits.detach().float(), dim=1)
    return -(log_probabilities.exp() * log_probabilities).sum(dim=1)


def hard_sample_probability(values: Tensor, iterations: int = 10) -> Tensor:
    """``[B]`` posterior probability that each value comes from the uniform ("hard") component.

    Fits ``π · N(μ, σ²) + (1 − π) · U(min, max)`` to ``values`` by ``iterations`` EM steps on their
    device, with no transfer to the host: the bulk of the batch (easy samples, entropies close
    together) is the Gaussian; samples whose entropy lies outside it, spread over the range, are
    the uniform. Starts from ``π = ½`` and the values' mean and variance. Only samples *above* the
    Gaussian's mean can be hard (a very confident sample is not); equal values are all easy; the
    Gaussian's standard deviation is kept ≥ 0.1% of the range, so a tight bulk stays the bulk.

    Raises:
        ValueError: for ``values`` that are not ``[B]``, or ``iterations`` < 1.

    Example::

        >>> entropy = torch.tensor([0.10, 0.11, 0.09, 0.10, 0.12, 0.08, 2.0])
        >>> [round(p, 2) for p in hard_sample_probability(entropy).tolist()]
        [0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 1.0]
    """
    if values.dim() != 1:
        raise ValueError(f"`values` {list(values.shape)} must be one value per sample, [B]")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"`iterations`={iterations!r} must be an int ≥ 1")
    values = values.detach().float()
    spread = values.max() - values.min()
    uniform_density = 1.0 / spread.clamp_min(torch.finfo(values.dtype).tiny)
    floor = (_RELATIVE_FLOOR * spread).pow(2).clamp_min(torch.finfo(values.dtype).tiny)  # the bulk's least variance
    weight = values.new_tensor(0.5)
    mean, variance = values.mean(), values.var(unbiased=False).clamp_min(floor)
    for _ in range(iterations):
        gaussian = weight * torch.exp(-0.5 * (values - mean).pow(2) / variance) / torch.sqrt(2 * torch.pi * variance)
        uniform = (1 - weight) * uniform_density
        responsibility = gaussian / (gaussian + uniform).clamp_min(torch.finfo(values.dtype).tiny)
        total = responsibility.sum().clamp_min(_EPS)
        weight = (total / values.numel()).clamp(_EPS, 1 - _EPS)
        mean = (responsibility * values).sum() / total
        variance = ((responsibility * (values - mean).pow(2)).sum() / total).clamp_min(floor)
    # hard means more uncertain than the bulk: values below its mean are easy, and equal values all easy
    hard = torch.where(values > mean, 1 - responsibility, torch.zeros_like(values))
    return torch.where(spread > 0, hard, torch.zeros_like(values))
