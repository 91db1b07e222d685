"""Run a model surgery once the LightningModule's layers exist, before the strategy wraps them."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden


def after_configure_model(pl_module: LightningModule, action: Callable[[], None]) -> None:
    """Run ``action`` now, or right after ``pl_module.configure_model`` when the module builds its layers there.

    Call it from a callback's ``setup``: Lightning calls ``configure_model`` after ``setup`` and
    before the strategy wraps the model. Several callbacks may chain onto the same module.

    Example::

        >>> class Late(LightningModule):
        ...     def configure_model(self):
        ...         self.layer = torch.nn.Linear(2, 2)
        >>> import torch
        >>> module, seen = Late(), []
        >>> after_configure_model(module, lambda: seen.append(hasattr(module, "layer")))
        >>> module.configure_model(); seen
        [True]

    Raises:
        TypeError: ``pl_module`` is no LightningModule, or ``action`` is not callable.
    """
    if not isinstance(pl_module, LightningModule):
        raise TypeError(f"`pl_module` must be a LightningModule, got {type(pl_module).__name__}")
    if not callable(action):
        raise TypeError(f"`action` must be a function of no arguments, got {action!r} ({type(action).__name__})")
    if not is_overridden("configure_model", pl_module):
        action()
        return
    configure_model = pl_module.configure_model
    previous = pl_module.__dict__.get("configure_model")  # another callback's chained hook, if any

    def configure_then_act() -> None:
        if previous is None:
            del pl_module.configure_model  # back to the class's own hook
        else:
            pl_module.configure_model = previous  # type: ignore[method-assign]
        configure_model()
        action()

    pl_module.configure_model = configure_then_act  # type: ignore[method-assign]
