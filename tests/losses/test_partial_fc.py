import pytest
import torch
import torch.nn.functional as F

from lightning_memopt.losses import CombinedMarginLoss, PartialFC


def _full_softmax_loss(embeddings, weight, labels, margin_loss):
    cosine = F.linear(F.normalize(embeddings), F.normalize(weight))
    return margin_loss(cosine, labels)


def test_rate_one_is_numerically_identical_to_the_full_margin_softmax():
    torch.manual_seed(0)
    head = PartialFC(num_classes=50, embedding_size=16, sample_rate=1.0)
    embeddings = torch.randn(12, 16, requires_grad=True)
    labels = torch.randint(0, 50, (12,))
    loss, cosine, target = head(embeddings, labels)
    loss.backward()

    weight = head.weight.detach().clone().requires_grad_(True)
    reference_embeddings = embeddings.detach().clone().requires_grad_(True)
    reference = _full_softmax_loss(reference_embeddings, weight, labels, head.margin_loss)
    reference.backward()

    assert torch.equal(loss, reference)
    assert torch.equal(head.weight.grad, weight.grad)
    assert torch.equal(embeddings.grad, reference_embeddings.grad)
    assert cosine.shape == (12, 50) and torch.equal(target, labels)


def test_sampling_keeps_every_positive_and_fills_up_with_distinct_negatives():
    torch.manual_seed(1)
    head = PartialFC(num_classes=1000, embedding_size=8, sample_rate=0.1)
    labels = torch.tensor([5, 999, 5, 17, 640, 17])
    class_index, target = head.sample_classes(labels)
    assert class_index.numel() == 100 == head.num_sample
    assert class_index.unique().numel() == 100
    assert set(class_index.tolist()) >= {5, 17, 640, 999}
    assert torch.equal(class_index, class_index.sort().values)
    assert torch.equal(class_index[target], labels)


def test_sampled_loss_uses_only_sampled_centres_and_leaves_the_others_without_gradient():
    torch.manual_seed(2)
    head = PartialFC(num_classes=200, embedding_size=8, sample_rate=0.05)
    labels = torch.tensor([3, 150, 3, 42])
    torch.manual_seed(7)
    loss, cosine, target = head(torch.randn(4, 8), labels)
    loss.backward()
    torch.manual_seed(7)
    torch.randn(4, 8)  # replay the same random stream to draw the same negatives
    class_index, expected_target = head.sample_classes(labels)
    assert cosine.shape == (4, 10) and torch.equal(target, expected_target)
    has_gradient = head.weight.grad.abs().sum(dim=1) > 0
    assert set(has_gradient.nonzero().squeeze(1).tolist()) <= set(class_index.tolist())
    assert has_gradient[[3, 150, 42]].all()


def test_more_positives_than_the_sample_size_keeps_just_the_positives():
    head = PartialFC(num_classes=100, embedding_size=4, sample_rate=0.02)
    labels = torch.tensor([9, 1, 50, 1])
    class_index, target = head.sample_classes(labels)
    assert torch.equal(class_index, torch.tensor([1, 9, 50]))
    assert torch.equal(class_index[target], labels)


def test_eval_mode_scores_against_every_class():
    head = PartialFC(num_classes=100, embedding_size=4, sample_rate=0.1).eval()
    _, cosine, target = head(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    assert cosine.shape == (3, 100) and torch.equal(target, torch.tensor([0, 1, 2]))


def test_head_runs_in_fp32_under_autocast():
    head = PartialFC(num_classes=10, embedding_size=4, margin_loss=CombinedMarginLoss((1.0, 0.0, 0.4)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, cosine, _ = head(torch.randn(3, 4, dtype=torch.bfloat16), torch.tensor([0, 1, 2]))
    assert loss.dtype == cosine.dtype == torch.float32


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_sample_rate_outside_zero_one_is_refused(rate):
    with pytest.raises(ValueError, match=rf"`sample_rate`={rate!r} must be in \(0, 1\]"):
        PartialFC(num_classes=10, embedding_size=4, sample_rate=rate)


def test_labels_outside_the_classes_are_refused_when_sampling():
    head = PartialFC(num_classes=10, embedding_size=4, sample_rate=0.5)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*got values in \[0, 10\]"):
        head(torch.randn(2, 4), torch.tensor([0, 10]))


def test_sampling_runs_on_fake_tensors_with_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    head = PartialFC(num_classes=1000, embedding_size=16, sample_rate=0.1)
    with FakeTensorMode() as mode:
        fake_head = PartialFC(num_classes=1000, embedding_size=16, sample_rate=0.1)
        labels = mode.from_tensor(torch.randint(0, 1000, (32,)))
        _, cosine, target = fake_head(torch.randn(32, 16), labels)
    _, real_cosine, _ = head(torch.randn(32, 16), torch.randint(0, 1000, (32,)))
    assert cosine.shape == real_cosine.shape == (32, 100) and target.shape == (32,)
