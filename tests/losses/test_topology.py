import pytest
import torch

from lightning_memopt.losses import (
    TopologicalAlignmentLoss,
    minimum_spanning_tree,
    pairwise_distances,
    topological_alignment_loss,
)
from lightning_memopt.memory import MemoryTracker


def broadcast_distances(points):
    """The reference formulation: a B × B × D difference tensor."""
    flat = points.reshape(points.shape[0], -1).double()
    eye = torch.eye(flat.shape[0], dtype=flat.dtype)  # sqrt(0) on the diagonal would give NaN gradients
    return ((flat[:, None] - flat[None]).pow(2).sum(dim=-1) + eye).sqrt() - eye


def kruskal(distances):
    """Union–find over the upper-triangle edges sorted by (length, i, j)."""
    size = distances.shape[0]
    parent = list(range(size))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    edges = sorted((distances[i, j].item(), i, j) for i in range(size) for j in range(i + 1, size))
    tree = []
    for _, i, j in edges:
        if root(i) != root(j):
            parent[root(i)] = root(j)
            tree.append([i, j])
    return tree


def reference_loss(images, embeddings, variant):
    x, z = broadcast_distances(images), broadcast_distances(embeddings)
    pi_x, pi_z = torch.tensor(kruskal(x)), torch.tensor(kruskal(z))
    ax_x, az_x = x[pi_x[:, 0], pi_x[:, 1]], z[pi_x[:, 0], pi_x[:, 1]]
    ax_z, az_z = x[pi_z[:, 0], pi_z[:, 1]], z[pi_z[:, 0], pi_z[:, 1]]
    if variant == "diagram":
        return (ax_x - az_z).pow(2).sum() / images.shape[0]
    return 0.5 * ((ax_x - az_x).pow(2).sum() + (az_z - ax_z).pow(2).sum()) / images.shape[0]


def batch(size, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, 3, 12, 12, generator=generator), torch.randn(size, 16, generator=generator)


@pytest.mark.parametrize("size", [2, 3, 17, 64])
@pytest.mark.parametrize("variant", ["diagram", "symmetric"])
def test_loss_and_tree_match_the_broadcast_kruskal_reference(size, variant):
    for seed in range(3):
        images, embeddings = batch(size, seed)
        assert minimum_spanning_tree(pairwise_distances(images)).tolist() == kruskal(broadcast_distances(images))
        assert minimum_spanning_tree(pairwise_distances(embeddings)).tolist() == kruskal(
            broadcast_distances(embeddings)
        )
        ours = TopologicalAlignmentLoss(variant)(images, embeddings.requires_grad_())
        expected = reference_loss(images, embeddings.detach(), variant)
        assert ours.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("variant", ["diagram", "symmetric"])
def test_gradient_reaches_the_embeddings_only_and_matches_the_reference(variant):
    images, embeddings = batch(24, 5)
    images.requires_grad_()
    ours = embeddings.clone().requires_grad_()
    TopologicalAlignmentLoss(variant)(images, ours).backward()
    theirs = embeddings.double().requires_grad_()
    reference_loss(images.detach(), theirs, variant).backward()
    assert images.grad is None  # the input space is a target
    torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-6)
    double = embeddings.double().requires_grad_()
    check = lambda z: topological_alignment_loss(pairwise_distances(images.detach().double()),  # noqa: E731
                                                 pairwise_distances(z), variant)  # fmt: skip
    assert torch.autograd.gradcheck(check, (double,))


def test_tied_distances_follow_the_length_then_index_order():
    square = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.0], [4.0, 0.0]])
    tree = minimum_spanning_tree(pairwise_distances(square))
    assert tree.tolist() == kruskal(broadcast_distances(square)) == [[0, 1], [0, 2], [1, 3], [4, 5], [1, 4]]
    line = torch.arange(8.0)[torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])][:, None]  # all neighbours 1 apart
    assert minimum_spanning_tree(pairwise_distances(line)).tolist() == kruskal(broadcast_distances(line))
    same = torch.zeros(5, 3)  # every distance 0: a star from the lowest indices
    assert minimum_spanning_tree(pairwise_distances(same)).tolist() == [[0, 1], [0, 2], [0, 3], [0, 4]]


def test_coincident_points_give_finite_gradients():
    embeddings = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    distances = pairwise_distances(embeddings)
    assert distances[0, 1].item() == 0.0
    topological_alignment_loss(pairwise_distances(torch.randn(3, 4)), distances).backward()
    assert torch.isfinite(embeddings.grad).all()


def test_the_tree_is_built_without_reading_values_on_the_host():
    """On the meta device no tensor has values: any host read (a CUDA sync) would raise here."""
    images = torch.empty(32, 3, 112, 112, device="meta")
    embeddings = torch.empty(32, 512, device="meta", requires_grad=True)
    loss = topological_alignment_loss(pairwise_distances(images), pairwise_distances(embeddings))
    loss.backward()
    assert embeddings.grad.shape == (32, 512)


def test_memory_is_b_squared_not_b_squared_d():
    images, embeddings = batch(32, 1)
    images = torch.rand(32, 3, 32, 32)
    embeddings.requires_grad_()
    tracker = MemoryTracker()
    with tracker:
        TopologicalAlignmentLoss()(images, embeddings).backward()
    extra = tracker.peak.total_bytes - images.numel() * 4  # the tracker meets the images first in the loss
    broadcast = 32 * 32 * images[0].numel() * 4
    assert extra < broadcast / 150
    assert extra < 32 * 32 * 8 * 12 + embeddings.numel() * 8 * 4  # a dozen fp64 B × B matrices, a few B × d


def test_half_precision_embeddings_are_scored_in_fp32_under_autocast():
    images, embeddings = batch(16, 2)
    expected = TopologicalAlignmentLoss()(images, embeddings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = TopologicalAlignmentLoss()(images.bfloat16(), embeddings.bfloat16())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=0.05)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: TopologicalAlignmentLoss("wasserstein"), "Unknown `variant`='wasserstein'; valid choices: diagram"),
        (lambda: TopologicalAlignmentLoss()(torch.randn(1, 4), torch.randn(1, 2)), r"B ≥ 2 \(a spanning tree"),
        (lambda: TopologicalAlignmentLoss()(torch.randn(4, 4), torch.randn(3, 2)), r"`inputs` \[4, 4\] and `emb"),
        (lambda: minimum_spanning_tree(torch.zeros(3, 4)), r"`distances` \[3, 4\] must be a square"),
        (lambda: topological_alignment_loss(torch.zeros(3, 3), torch.zeros(4, 4)), "must describe the same batch"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.cuda
def test_on_cuda_the_loss_matches_the_cpu_and_never_synchronises():
    images, embeddings = batch(64, 3)
    expected = TopologicalAlignmentLoss()(images, embeddings)
    images, embeddings = images.cuda(), embeddings.cuda().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = TopologicalAlignmentLoss()(images, embeddings)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_infinite_distances_still_give_a_spanning_set_of_distinct_edges():
    inf = float("inf")
    distances = torch.tensor([[0.0, inf, 1.0], [inf, 0.0, inf], [1.0, inf, 0.0]])
    assert minimum_spanning_tree(distances).tolist() == [[0, 2], [0, 1]]
