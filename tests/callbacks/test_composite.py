import inspect

import pytest
from lightning.pytorch import Callback

from lightning_memopt.callbacks.composite import FORWARDED_HOOKS, CallbackGroup

# CallbackGroup's own methods among Callback's (the rest are forwarded as they are)
OWN = {"state_dict", "load_state_dict", "on_load_checkpoint"}


def test_every_hook_of_lightnings_callback_is_forwarded_or_handled():
    hooks = {name for name, value in vars(Callback).items() if inspect.isfunction(value) and not name.startswith("_")}
    assert set(FORWARDED_HOOKS) | OWN == hooks
    assert len(FORWARDED_HOOKS) == len(set(FORWARDED_HOOKS)) and not OWN & set(FORWARDED_HOOKS)
    for name in hooks:
        assert getattr(CallbackGroup, name) is not getattr(Callback, name), name


class Recorder(Callback):
    def __init__(self, name, calls, state=None):
        self.name, self.calls, self.state, self.loaded = name, calls, state, None

    @property
    def state_key(self):
        return self.name

    def __getattribute__(self, attribute):
        if attribute in FORWARDED_HOOKS:
            return lambda *args, **kwargs: self.calls.append((self.name, attribute, args, kwargs))
        return super().__getattribute__(attribute)

    def state_dict(self):
        return dict(self.state) if self.state else {}

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


@pytest.mark.parametrize("name", FORWARDED_HOOKS)
def test_each_hook_runs_every_owned_callbacks_hook_in_order_with_its_arguments(name):
    calls = []
    group = CallbackGroup([Recorder("a", calls), Recorder("b", calls)])
    getattr(group, name)("trainer", "module", "extra", key="value")
    assert calls == [(who, name, ("trainer", "module", "extra"), {"key": "value"}) for who in ("a", "b")]


def test_states_are_saved_in_the_groups_entry_and_loaded_back():
    first, second = Recorder("a", [], {"x": 1}), Recorder("b", [])  # b has no state
    group = CallbackGroup([first, second])
    assert group.state_dict() == {"callbacks": {"a": {"x": 1}}}
    fresh = [Recorder("a", []), Recorder("b", [])]
    CallbackGroup(fresh).load_state_dict(group.state_dict())
    assert fresh[0].loaded == {"x": 1} and fresh[1].loaded is None
    assert CallbackGroup([Recorder("a", [])]).state_dict() == {}  # nothing to save: no entry


def test_states_saved_under_the_callbacks_own_keys_are_moved_into_the_groups_entry():
    # as a checkpoint written while they were the Trainer's own callbacks
    checkpoint = {"callbacks": {"a": {"x": 1}, "b": {"y": 2}, "Other": {"z": 3}, "CallbackGroup": {"mine": 0}}}
    group = CallbackGroup([Recorder("a", []), Recorder("b", [])])
    group.on_load_checkpoint("trainer", "module", checkpoint)
    own = checkpoint["callbacks"]["CallbackGroup"]
    assert own == {"mine": 0, "callbacks": {"a": {"x": 1}, "b": {"y": 2}}}
    group.load_state_dict(own)
    assert [c.loaded for c in group.callbacks] == [{"x": 1}, {"y": 2}]
    newer = {"callbacks": {"a": {"x": 5}, "CallbackGroup": {"callbacks": {"a": {"x": 9}}}}}
    group.on_load_checkpoint("trainer", "module", newer)  # the group's own layout wins
    assert newer["callbacks"]["CallbackGroup"] == {"callbacks": {"a": {"x": 9}}}


def test_owned_callbacks_with_one_state_key_are_refused():
    from lightning_memopt.callbacks import StepAccumulationScheduler

    with pytest.raises(RuntimeError, match=r"share the state key\(s\) StepAccumulationScheduler"):
        CallbackGroup([StepAccumulationScheduler(), StepAccumulationScheduler()])
    group = CallbackGroup([StepAccumulationScheduler()])
    with pytest.raises(RuntimeError, match="would overwrite each other"):
        group.callbacks = [*group.callbacks, StepAccumulationScheduler()]
