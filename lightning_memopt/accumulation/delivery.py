"""Hand the gradients the micro-batches accumulated to the training loop's own backward pass.

The micro-batches ran their backward passes already. The step returns a loss whose backward
hands every parameter its accumulated gradient, so the loop's single backward per batch is what
gradient clipping, the gradient scaler, backward hooks and DDP's reducer (one all-reduce per step) see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memopt.accumulation.micro_batch import MicroBatchResult
from lightning_memopt.accumulation.split import with_loss


class _DeliverGradients(torch.autograd.Function):
    """Forward: the batch's loss, detached. Backward: the gradients the micro-batches accumulated.

    Lightning's own backward on this output hands every parameter its gradient. That lets DDP's
    reducer all-reduce it once per step, and it runs the backward hooks once per batch. Under
    FSDP each micro-batch's backward has reduce-scattered its gradients already: the sharded
    gradients (DTensors) are handed back as they are. The gradients already carry the loss
    weights and the gradient scaler's scale, so the incoming gradient (``scale /
    accumulate_grad_batches``) is not applied to them again.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, gradients: list[torch.Tensor], *parameters: torch.Tensor) -> torch.Tensor:
        ctx.gradients = gradients
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gradients, ctx.gradients = ctx.gradients, None  # let autograd move them into .grad without a copy
        result = (None, None, *gradients)
        gradients.clear()
        return result


def deliver(module: nn.Module, result: MicroBatchResult) -> Any:
    """The step's output, its loss carrying ``module``'s accumulated gradients to the loop's backward.

    The gradients leave ``.grad`` (the loop's ``zero_grad`` before its backward finds nothing to
    clear) and come back when the returned loss is back-propagated, with any incoming gradient ignored.

    Example::

        >>> from lightning_memopt.accumulation import MicroBatchRunner
        >>> model = torch.nn.Linear(3, 1)
        >>> result = MicroBatchRunner(model).run(lambda x: model(x).mean(), torch.ones(4, 3), 2,
        ...                                      backward=torch.Tensor.backward)
        >>> output = deliver(model, result)
        >>> model.bias.grad is None
        True
        >>> output.backward(torch.tensor(0.5))  # the loop's backward, its scale already applied
        >>> model.bias.grad  # the whole batch's mean, the incoming 0.5 not applied again
        tensor([1.])
    """
    if result.loss is None:
        return result.output
    parameters = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
    gradients = [p.grad for p in parameters]
    for parameter in parameters:
        parameter.grad = None  # Lightning's zero_grad, which runs before its backward, finds nothing to clear
    return with_loss(result.output, _DeliverGradients.apply(result.loss, gradients, *parameters))


def scaled_backward(backward: Callable[[torch.Tensor], None], scaler: Any = None) -> Callable[[torch.Tensor], None]:
    """``backward`` of each micro-batch's loss, scaled by the gradient ``scaler`` (if any), outside autocast.

    As Lightning runs its backward: outside the training step's autocast, through the module's
    ``backward`` hook (pass ``pl_module.backward``; ``torch.Tensor.backward`` for a plain module).

    Example::

        >>> weight = torch.ones(2, requires_grad=True)
        >>> scaled_backward(torch.Tensor.backward)((weight * 3).sum())
        >>> weight.grad
        tensor([3., 3.])
    """

    def run(loss: torch.Tensor) -> None:
        with torch.autocast(loss.device.type, enabled=False):
            backward(scaler.scale(loss) if scaler is not None else loss)

    return run
