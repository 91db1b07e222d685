"""CallbackGroup: one Trainer callback that owns others and forwards every Lightning hook to them, in order.

A callback that applies its decisions through other callbacks (:class:`~lightning_memopt.MemoryBudget`)
owns them instead of adding them to ``trainer.callbacks``: the Trainer lists the group only, and
each hook of the group runs the owned callbacks' hook within it, so the group can decide in
``setup`` which callbacks it needs and have their ``setup`` run in the same hook. Their states are
saved inside the group's own checkpoint entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

# every hook Lightning calls as hook(trainer, pl_module, *args): forwarded as it is to each owned callback
# (Callback's other methods, state_dict / load_state_dict / on_load_checkpoint, are CallbackGroup's own below;
# tests/callbacks/test_composite.py checks that this list and those cover every hook of Lightning's Callback)
FORWARDED_HOOKS = (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_exception",
    "on_save_checkpoint",
)


class CallbackGroup(Callback):
    """Own ``callbacks`` and run each Lightning hook of theirs, in their order, within the group's own hook.

    Checkpoints keep the owned callbacks' states in the group's entry, under ``group_state_key``, by
    each callback's ``state_key`` (distinct within a group). A checkpoint written while they were
    the Trainer's own callbacks, each state under its own key, is read too (``on_load_checkpoint``).
    A subclass overriding a hook calls ``super()`` for the owned callbacks' turn.

    Args:
        callbacks: the callbacks owned, in the order their hooks run; the list can change between fits.

    Raises:
        RuntimeError: when two owned callbacks share a ``state_key`` (their states would overwrite each
            other), as Lightning refuses it for the Trainer's own callbacks.

    Example::

        >>> class Counter(Callback):
        ...     calls = 0
        ...     def on_train_start(self, trainer, pl_module):
        ...         self.calls += 1
        ...     def state_dict(self):
        ...         return {"calls": self.calls}
        >>> group = CallbackGroup([Counter()])
        >>> group.on_train_start(None, None)
        >>> group.state_dict()
        {'callbacks': {'Counter': {'calls': 1}}}
    """

    group_state_key = "callbacks"

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)

    @property
    def callbacks(self) -> list[Callback]:
        """The owned callbacks, in the order their hooks run (assign a new list to change them)."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Iterable[Callback]) -> None:
        owned = list(callbacks)
        keys = [callback.state_key for callback in owned]
        shared = sorted({key for key in keys if keys.count(key) > 1})
        if shared:
            raise RuntimeError(
                f"{type(self).__name__}: the callbacks it owns share the state key(s) {', '.join(shared)}: their "
                "checkpoint states would overwrite each other; give them distinct arguments (or `state_key`s)"
            )
        self._callbacks = owned

    @override
    def state_dict(self) -> dict[str, Any]:
        states = self.callback_states()
        return {self.group_state_key: states} if states else {}

    def callback_states(self) -> dict[str, Any]:
        """The owned callbacks' states by their ``state_key`` (those with a state)."""
        return {callback.state_key: state for callback in self.callbacks if (state := callback.state_dict())}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_callback_states(state_dict.get(self.group_state_key) or {})

    def load_callback_states(self, states: Mapping[str, Any]) -> None:
        """Give each owned callback its state from ``states`` (by ``state_key``; one without an entry keeps its own)."""
        for callback in self.callbacks:
            state = states.get(callback.state_key)
            if state:
                callback.load_state_dict(deepcopy(state))

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_load_checkpoint(trainer, pl_module, checkpoint)
        self._adopt_separate_states(checkpoint)

    def _adopt_separate_states(self, checkpoint: dict[str, Any]) -> None:
        """Move the states a checkpoint holds under the owned callbacks' own keys (written while they were the
        Trainer's callbacks) into the group's entry, where ``load_state_dict`` reads them: Lightning calls every
        callback's ``on_load_checkpoint`` before any ``load_state_dict``, each with the checkpoint's entry then."""
        saved = checkpoint.get("callbacks")
        if not isinstance(saved, dict):
            return
        own = saved.get(self.state_key) or {}
        if self.group_state_key in own:
            return
        separate = {c.state_key: saved[c.state_key] for c in self.callbacks if c.state_key in saved}
        if not separate:
            return
        saved[self.state_key] = {**own, self.group_state_key: separate}
        rank_zero_info(
            f"{type(self).__name__}: restoring {', '.join(separate)} from their own entries of the checkpoint (written "
            f"before {type(self).__name__} owned them); Lightning's warning that the Trainer lacks them does not apply"
        )


def _forwarding(name: str) -> Callable[..., None]:
    def hook(self: CallbackGroup, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, name)(trainer, pl_module, *args, **kwargs)

    hook.__name__ = name
    hook.__qualname__ = f"{CallbackGroup.__qualname__}.{name}"
    hook.__doc__ = f"Run each owned callback's ``{name}``, in order."
    return hook


for _name in FORWARDED_HOOKS:
    setattr(CallbackGroup, _name, _forwarding(_name))
