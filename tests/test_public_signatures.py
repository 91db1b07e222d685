"""Every public constructor is documented and precisely typed, and each ``Literal`` of names equals its runtime tuple.

Config tools read the signatures: jsonargparse / ``LightningCLI`` turn a ``Literal`` into the choices
of ``--help`` and refuse other values, and take the ``Args:`` text as each argument's help. These
tests keep that true as classes and arguments are added.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import typing

import pytest

# the packages whose exported classes users configure (by Python, Hydra or LightningCLI)
PUBLIC_PACKAGES = (
    "lightning_memopt.callbacks",
    "lightning_memopt.strategies",
    "lightning_memopt.tasks",
    "lightning_memopt.data",
    "lightning_memopt.metrics",
    "lightning_memopt.losses",
)
# exported classes that no user configures
NOT_CONFIGURED = {
    "FitSummary": "the figures TrainingSummary measured (a result record, built by the callback)",
}
# arguments whose type really is anything
ANY_ALLOWED = {
    ("MemoryBudget", "sample_batch"): "a batch in whatever form the module's training_step takes",
    ("ActivationCheckpointing", "sample_batch"): "a batch in whatever form the module's training_step takes",
}


def public_classes() -> list[type]:
    """The classes exported by :data:`PUBLIC_PACKAGES` that define their own ``__init__``."""
    found: dict[str, type] = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and "__init__" in vars(value) and name not in NOT_CONFIGURED:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[key] for key in sorted(found)]


CLASSES = public_classes()


def documented_arguments(cls: type) -> list[str]:
    """The names of the class docstring's ``Args:`` section (``**kwargs`` as ``kwargs``), in order."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = re.search(r"^Args:\n((?:[ \t]+\S.*\n|[ \t]*\n)*)", doc + "\n", flags=re.MULTILINE)
    if section is None:
        return []
    # an entry is one indented line "name: ..." (Google style, what jsonargparse's docstring parser reads)
    return re.findall(r"^    \*{0,2}(\w+)(?: \([^)]*\))?:", section.group(1), flags=re.MULTILINE)


def constructor_parameters(cls: type) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    return [p for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]


def test_public_classes_are_found():
    names = {cls.__name__ for cls in CLASSES}
    assert {"ActivationCheckpointing", "MemoptDDPStrategy", "FaceRecognitionModule", "KNNRetrieval"} <= names
    assert {"SyntheticFaceDataModule", "TopologicalAlignmentLoss", "MemoryMonitor", "TrainingSummary"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_constructor_argument_is_documented(cls):
    documented = documented_arguments(cls)
    names = [p.name for p in constructor_parameters(cls)]
    missing = [name for name in names if name not in documented]
    assert not missing, f"{cls.__name__}: arguments missing from the docstring's `Args:` section: {missing}"
    stale = [name for name in documented if name not in names]
    assert not stale, f"{cls.__name__}: `Args:` names what the constructor does not take: {stale}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_constructor_argument_has_a_precise_type(cls):
    hints = typing.get_type_hints(
        cls.__init__
    )  # resolves the string annotations of `from __future__ import annotations`
    for parameter in constructor_parameters(cls):
        assert parameter.name in hints, f"{cls.__name__}({parameter.name}) has no type annotation"
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue  # **kwargs go to a documented base class, whose own signature types them (jsonargparse follows it)
        if (cls.__name__, parameter.name) in ANY_ALLOWED:
            continue
        assert hints[parameter.name] is not typing.Any, (
            f"{cls.__name__}({parameter.name}) is annotated `Any`: give its precise type (a Literal of its names)"
        )


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_literal_defaults_are_among_the_choices(cls):
    hints = typing.get_type_hints(cls.__init__)
    for parameter in constructor_parameters(cls):
        if parameter.default in (inspect.Parameter.empty, None) or parameter.name not in hints:
            continue
        choices = literal_choices(hints[parameter.name])
        open_ended = any(_accepts_other_values(member) for member in _union_members(hints[parameter.name]))
        if choices and not open_ended:
            assert parameter.default in choices, f"{cls.__name__}({parameter.name}={parameter.default!r}): {choices}"


def _union_members(hint: object) -> tuple[object, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)


_UnionType = type(int | str)


def literal_choices(hint: object) -> set[object]:
    """The values of every ``Literal`` in ``hint`` (a Literal, or a union with Literals in it)."""
    literals = [member for member in _union_members(hint) if typing.get_origin(member) is typing.Literal]
    return {value for literal in literals for value in typing.get_args(literal)}


def _accepts_other_values(member: object) -> bool:
    return typing.get_origin(member) is not typing.Literal and member is not type(None)


def _names():
    def module(name: str):  # (by module path: a package may export a function of the module's name)
        return importlib.import_module(f"lightning_memopt.{name}")

    runner, policy, vocabulary = (
        module("accumulation.runner"),
        module("checkpointing.policy"),
        module("vocabulary"),
    )
    margin, topology, knn = module("losses.margin"), module("losses.topology"), module("metrics.functional.knn")
    hardware, schedule = module("planner.hardware"), module("precision.schedule")
    comm_hooks, fsdp = module("strategies.comm_hooks"), module("strategies.fsdp")
    face_recognition, task_common = module("tasks.face_recognition"), module("tasks.common")
    return {
        "PrecisionName": (vocabulary.PrecisionName, vocabulary.PRECISIONS),
        "PrecisionAlias": (vocabulary.PrecisionAlias, tuple(vocabulary.PRECISION_ALIASES)),
        "ScheduleInterval": (schedule.ScheduleInterval, schedule.INTERVALS),
        "CheckpointMode": (vocabulary.CheckpointMode, vocabulary.CHECKPOINT_MODES),
        "AutoBlocks": (policy.AutoBlocks, policy.AUTO),
        "PolicyKeyword": (policy.PolicyKeyword, tuple(policy.KEYWORDS)),
        "LossReduction": (runner.LossReduction, runner.LOSS_REDUCTIONS),
        "CommHookName": (comm_hooks.CommHookName, comm_hooks.COMM_HOOKS),
        "ParamDtype": (fsdp.ParamDtype, tuple(fsdp.PARAM_DTYPES)),
        "GpuName": (hardware.GpuName, tuple(hardware.GPUS)),
        "AttentionImpl": (vocabulary.AttentionImpl, vocabulary.ATTENTION_IMPLS),
        "CheckpointKnob": (vocabulary.CheckpointKnob, vocabulary.CHECKPOINT_KNOBS),
        "OptimizerName": (face_recognition.OptimizerName, face_recognition.OPTIMIZERS),
        "ScheduleName": (task_common.ScheduleName, task_common.SCHEDULES),
        "TopologyVariant": (topology.TopologyVariant, topology.VARIANTS),
        "Reduction": (margin.Reduction, margin.REDUCTIONS),
        "DistanceMetric": (knn.DistanceMetric, knn.METRICS),
        "SearchBackend": (knn.SearchBackend, knn.BACKENDS),
    }


@pytest.mark.parametrize("name", sorted(_names()))
def test_literal_equals_the_runtime_names(name):
    alias, names = _names()[name]
    assert typing.get_args(alias) == tuple(names), f"{name} and the names checked at run time have drifted apart"


def test_precision_setting_takes_auto_the_names_and_the_aliases():
    from lightning_memopt.vocabulary import PRECISION_ALIASES, PRECISIONS, PrecisionSetting

    strings, integers = typing.get_args(PrecisionSetting)
    assert typing.get_args(strings) == ("auto", *PRECISIONS, *PRECISION_ALIASES)
    assert {str(value) for value in typing.get_args(integers)} <= set(PRECISION_ALIASES)


def test_knobs_mapping_has_the_knobs_fields():
    from lightning_memopt.planner.knobs import FIELDS, Knobs, KnobsMapping

    assert tuple(KnobsMapping.__annotations__) == FIELDS == tuple(f.name for f in dataclasses.fields(Knobs))


def test_policy_mapping_has_the_policy_keys():
    from lightning_memopt.checkpointing.policy import POLICY_KEYS, PolicyMapping

    assert tuple(PolicyMapping.__annotations__) == POLICY_KEYS


def test_schedule_entry_mapping_has_the_entry_keys():
    from lightning_memopt.precision.schedule import _ENTRY_KEYS, ScheduleEntryMapping

    assert tuple(ScheduleEntryMapping.__annotations__) == _ENTRY_KEYS
