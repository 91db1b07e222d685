"""Gradient coverage: up to which sample each parameter's gradient is complete, so nothing is counted twice.

An out-of-memory error in a micro-batch's backward pass leaves the gradients of the parameters it
had already reached. When the failed micro-batch is redone in smaller pieces, those parameters must
take no second contribution for the same samples. No gradient copy is made: a post-accumulate hook
records how far each parameter's gradient reaches, and a gradient hook hands autograd zeros for
parameters whose gradient already holds the samples being redone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class GradientCoverage:
    """Track which samples each parameter's gradient holds, while the context is open.

    Args:
        parameters: the parameters that take gradients.

    Example::

        >>> layer = nn.Linear(2, 1)
        >>> with GradientCoverage(list(layer.parameters())) as coverage:
        ...     for _ in range(2):  # the same samples twice: the second adds nothing
        ...         with coverage.piece(3):
        ...             layer(torch.ones(3, 2)).sum().backward()
        >>> layer.bias.grad, coverage.covered
        (tensor([3.]), [3, 3])
    """

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        self.covered = [0] * len(parameters)  # per parameter: its gradient holds samples [0, covered)
        self._end = 0  # the end of the piece running now
        self._handles: list[Any] = []

    def __enter__(self) -> GradientCoverage:
        self._handles = [p.register_post_accumulate_grad_hook(self._landed(i)) for i, p in enumerate(self.parameters)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def piece(self, stop: int) -> Iterator[None]:
        """Run the piece that ends at sample ``stop``: parameters already holding it take a zero gradient."""
        done = [p.register_hook(_no_gradient) for i, p in enumerate(self.parameters) if self.covered[i] >= stop]
        self._end = stop
        try:
            yield
        finally:
            for handle in done:
                handle.remove()

    def _landed(self, index: int) -> Callable[[torch.Tensor], None]:
        def landed(parameter: torch.Tensor) -> None:
            self.covered[index] = max(self.covered[index], self._end)  # a skipped (zero) gradient also lands here

        return landed


def _no_gradient(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)
