"""What callbacks change on a LightningModule, in one place: its step hooks and its layers.

:class:`StepHooks` replaces a module's step hooks on the instance and puts them back;
:func:`after_configure_model` runs a model surgery once the module's layers exist, before the strategy wraps them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_memopt.private_api import point_logging_at

_ABSENT = object()

PieceRunner = Callable[[Callable[[Any], Any], Any], Any]  # run(step_on_a_piece, batch) -> the step's output


class StepHooks:
    """The step hooks replaced on one LightningModule instance, put back by :meth:`restore`.

    A replacement is an instance attribute; what it shadows (the class's method, or another
    callback's replacement) is put back, so that callbacks can chain and a module leaves a run as it came.

    Example::

        >>> class Module(LightningModule):
        ...     def predict_step(self, batch):
        ...         return batch * 2
        >>> module, hooks = Module(), StepHooks()
        >>> hooks.split(None, module, "predict_step", lambda step, batch: [step(piece) for piece in batch])
        >>> module.predict_step([1, 2])
        [2, 4]
        >>> hooks.restore(module)
        >>> "predict_step" in module.__dict__, module.predict_step(3)
        (False, 6)
    """

    def __init__(self) -> None:
        self._originals: dict[str, Any] = {}  # hook name -> the instance attribute it replaced (or _ABSENT)

    def split(self, trainer: Trainer | None, module: LightningModule, name: str, run: PieceRunner) -> None:
        """Replace ``module``'s ``name`` hook by ``run(step_on_piece, batch)``, the step called on pieces of its batch.

        ``step_on_piece(piece)`` calls the hook as Lightning called it, with ``piece`` in place of the
        batch, and points ``self.log``'s batch size at it; after ``run``, logging points at the whole batch
        (``trainer=None``: nothing to point, outside a run).
        The replacement keeps the hook's signature (Lightning reads whether it takes ``batch_idx``).
        """
        original = getattr(module, name)

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            batch = args[0] if args else kwargs["batch"]
            try:
                return run(_on_pieces(trainer, original, args, kwargs), batch)
            finally:
                point_logging_at(trainer, batch)

        self.install(module, name, step)

    def install(self, module: LightningModule, name: str, hook: Callable[..., Any]) -> None:
        """Set ``hook`` as ``module``'s ``name``, remembering what it shadows the first time."""
        if name not in self._originals:
            self._originals[name] = module.__dict__.get(name, _ABSENT)
        setattr(module, name, hook)

    def uninstall(self, module: LightningModule, name: str) -> None:
        """Put back what ``name`` shadowed."""
        previous = self._originals.pop(name)
        if previous is _ABSENT:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, previous)

    def restore(self, module: LightningModule) -> None:
        """Put back every hook replaced."""
        for name in list(self._originals):
            self.uninstall(module, name)

    @contextlib.contextmanager
    def unwrapped(self, module: LightningModule, name: str) -> Iterator[None]:
        """``module``'s own ``name`` hook inside the context, the replacement again after it."""
        hook = module.__dict__[name]
        self.uninstall(module, name)
        try:
            yield
        finally:
            self.install(module, name, hook)


def _on_pieces(
    trainer: Trainer | None, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[Any], Any]:
    """``step`` called as Lightning called it, with a piece in place of the batch (and logged as one)."""

    def on_piece(piece: Any) -> Any:
        point_logging_at(trainer, piece)
        if args:
            return step(piece, *args[1:], **kwargs)
        return step(**{**kwargs, "batch": piece})

    return on_piece


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
