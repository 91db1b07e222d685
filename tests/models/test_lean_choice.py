"""Lean or plain: the normal head's blocks under ``"lean"`` and ``"full"`` checkpointing.

:class:`~lightning_memopt.models.normal_head.ConvNormAct` and
:class:`~lightning_memopt.models.normal_head.ConvNormActChain` recompute leanly in ``"lean"`` mode
(chunks and tiles as memory needs them: three forwards of the chain) and plainly in ``"full"`` mode
(one forward again, bitwise the unchecked head); what each costs in convolution FLOPs; a bad mode
refused by name. How finely the lean path is cut: test_lean_pieces.py; its exactness:
test_lean_recompute.py; the planner weighing both: tests/planner/test_lean_weighing.py.
"""

import pytest
import torch

from lightning_memopt.checkpointing import apply_activation_checkpointing
from lightning_memopt.memory.work import WorkCounter
from lightning_memopt.models.normal_head import NormalHead


def _head():
    torch.manual_seed(0)
    return NormalHead(16, deconv_channels=(8, 8, 8), conv_channels=(8, 8, 8), dropout=0.0)


def _step(head, mode=None):
    """(convolution FLOPs of a forward + backward, output, input gradient and parameter gradients)."""
    if mode is not None:
        assert apply_activation_checkpointing(head, mode) == 4  # three deconv stages, the chain
    x = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with WorkCounter() as counter:
        output = head(x)
        output.square().mean().backward()
    return counter.total().conv_flops, [output.detach(), x.grad, *(p.grad for p in head.parameters())]


def test_lean_mode_runs_the_chains_tiled_function_and_full_mode_does_not():
    def grad_fn_of_refine(mode):
        head = _head()
        apply_activation_checkpointing(head, mode)
        seen = []
        head.refine.register_forward_hook(lambda module, args, output: seen.append(output.grad_fn.name()))
        head(torch.randn(2, 16, 4, 3, requires_grad=True))
        return seen[0]

    assert grad_fn_of_refine("lean").startswith("TiledConvNormActChain")
    assert not grad_fn_of_refine("auto").startswith("TiledConvNormActChain")


def test_full_checkpointing_is_the_unchecked_head_bitwise():
    _, unchecked = _step(_head())
    _, plain = _step(_head(), "auto")
    assert all(torch.equal(a, b) for a, b in zip(unchecked, plain, strict=True))


def test_full_recomputes_one_forward_of_the_blocks_and_the_lean_chain_three():
    head = _head()
    x = torch.randn(2, 16, 8, 6)
    with WorkCounter() as counter:
        upsampled = head.upsample(x)
        deconvs = counter.total().conv_flops
        head.refine(upsampled)
        chain = counter.total().conv_flops - deconvs
    unchecked, _ = _step(_head())
    plain, _ = _step(_head(), "auto")
    lean, _ = _step(_head(), "lean")
    assert plain - unchecked == deconvs + chain  # one forward of the checkpointed blocks, nothing more
    # the deconvs' channel chunks add no work; the chain in backward: 3 + 1 + 2 + 3 stages, 3 forwards of it
    assert lean - unchecked == deconvs + 3 * chain


@pytest.mark.parametrize("mode", ["tiled", "plain", None])
def test_a_bad_mode_is_refused_by_name_with_the_value_and_the_choices(mode):
    message = rf"Unknown `mode`={mode!r}; valid choices: full, selective, offload, lean"
    with pytest.raises(ValueError, match=message):
        apply_activation_checkpointing(_head(), {"modules": "refine", "mode": mode})
