"""One stand-in per use: a traced block hands back the gradient of each use of a tensor apart, as autograd adds them.

Autograd adds the gradients a tensor takes from the ops that read it one at a time, the latest op first (the ops
after the block before those inside it). A traced block returning one summed gradient per tensor rounds otherwise
wherever the tensor is read several times inside the block and by something else too: a parameter of a block called
several times a step (CoTracker's correlation, once per level and iteration), an input that a later op reads again
(a skip connection, a context other blocks attend to). So a tensor that needs gradients and that the block reads
more than once is traced on one stand-in per reading call (a torch function given it that returns a tensor), and
the graph's autograd node takes the tensor once per use, the latest use first: autograd adds their gradients in the
plain step's order. A call that reads a tensor twice inside one function (``F.normalize``) still sums inside.

Example::

    >>> import torch
    >>> x = torch.randn(3)
    >>> with UseRouter({id(x): None}) as router:
    ...     _ = x.sin() + x.cos() * x.shape[0]  # .shape returns no tensor: no use
    >>> router.uses[id(x)]
    2
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_memopt.private_api import tree_flatten, tree_map


class UseRouter(TorchFunctionMode):
    """Counts the uses of some tensors, and gives each use its own stand-in where there are stand-ins.

    Args:
        stand_ins: by ``id`` of a watched tensor, its stand-ins, one per use, the last use's first (``None``: count
            only). A use past the last stand-in raises ``IndexError``.
    """

    def __init__(self, stand_ins: dict[int, list[torch.Tensor] | None]) -> None:
        super().__init__()
        self.stand_ins = stand_ins
        self.uses = dict.fromkeys(stand_ins, 0)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        taken: list[int] = []

        def route(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or id(value) not in self.uses:
                return value
            key = id(value)
            use = self.uses[key]
            self.uses[key] += 1
            taken.append(key)
            options = self.stand_ins[key]
            return value if options is None else options[len(options) - 1 - use]

        args, kwargs = tree_map(route, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(out)[0]):
            for key in taken:  # read for its metadata: no op reads it, no gradient comes back
                self.uses[key] -= 1
        return out


def repeated_positions(uses: dict[int, int]) -> list[int]:
    """Where the extra stand-ins of a call's tensors come from: each position read ``n`` times (``uses``, by
    position), ``n - 1`` times over, in position order.

    Example::

        >>> repeated_positions({0: 1, 2: 3, 5: 2})
        [2, 2, 5]
    """
    return [position for position, count in sorted(uses.items()) for _ in range(count - 1)]


def stand_ins_by_use(flat: tuple[torch.Tensor, ...], count: int, repeats: list[int]) -> dict[int, list[torch.Tensor]]:
    """For a traced call of ``count`` tensors followed by the extra stand-ins that ``repeats`` lists: each repeated
    tensor's stand-ins, the last use's first (the tensor's own position first, then its extras).

    Example::

        >>> a, b, a2, a3 = (torch.tensor(float(i)) for i in range(4))
        >>> [t.item() for t in stand_ins_by_use((a, b, a2, a3), 2, [0, 0])[id(a)]]
        [0.0, 2.0, 3.0]
    """
    routes: dict[int, list[torch.Tensor]] = {}
    for position, extra in zip(repeats, flat[count:], strict=True):
        routes.setdefault(id(flat[position]), [flat[position]]).append(extra)
    return routes
