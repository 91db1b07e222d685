"""jsonargparse (what ``LightningCLI`` parses with) reads every public constructor: defaults, choices, bad values.

Each class is added to a parser as ``LightningCLI`` adds a callback's or a strategy's ``init_args``:
its defaults parse and instantiate, a ``Literal`` argument takes one of its names, and a name outside
them is refused with the valid choices in the message.
"""

from __future__ import annotations

import inspect

import pytest

jsonargparse = pytest.importorskip("jsonargparse")
pytest.importorskip("docstring_parser")  # jsonargparse[signatures]: the Args: text becomes each argument's help

from lightning.pytorch import Callback  # noqa: E402

import lightning_memopt.callbacks as callbacks  # noqa: E402
from lightning_memopt.callbacks import (  # noqa: E402
    ActivationCheckpointing,
    AdaptiveAccumulation,
    MemoryBudget,
    PrecisionSwitch,
)
from lightning_memopt.data import SyntheticFaceDataModule, SyntheticNormalsDataModule  # noqa: E402
from lightning_memopt.losses import CombinedMarginLoss, TopologicalAlignmentLoss  # noqa: E402
from lightning_memopt.metrics import FaceVerification, KNNRetrieval  # noqa: E402
from lightning_memopt.strategies import MemoptDDPStrategy, MemoptFSDPStrategy  # noqa: E402
from lightning_memopt.tasks import FaceRecognitionModule  # noqa: E402

PARSE_ERRORS = tuple(
    getattr(jsonargparse, name) for name in ("ArgumentError", "ParserError") if hasattr(jsonargparse, name)
)
CALLBACKS = [
    getattr(callbacks, name)
    for name in callbacks.__all__
    if inspect.isclass(getattr(callbacks, name)) and issubclass(getattr(callbacks, name), Callback)
]
TINY_FACE_MODULE = ["--init.num_classes=4", "--init.backbone=iresnet_tiny", "--init.backbone_options={input_size: 32}"]


def parser_for(cls: type) -> jsonargparse.ArgumentParser:
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init")
    return parser


def build(cls: type, args: list[str]):
    """Parse ``args`` for ``cls`` and instantiate it, as LightningCLI does."""
    parser = parser_for(cls)
    config = parser.parse_args(args)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # (renamed in 4.49)
    return instantiate(config).init


def refused(cls: type, args: list[str]) -> str:
    with pytest.raises(PARSE_ERRORS) as error:
        parser_for(cls).parse_args(args)
    return str(error.value)


def test_every_callback_is_covered():
    names = {cls.__name__ for cls in CALLBACKS}
    assert {"ActivationCheckpointing", "AdaptiveAccumulation", "MemoryBudget", "MemoryMonitor"} <= names
    assert {"PrecisionSwitch", "TrainingSummary", "LastCheckpoint", "ValidationWithinEpoch"} <= names


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda cls: cls.__name__)
def test_callback_defaults_parse_and_instantiate(cls):
    assert isinstance(build(cls, []), cls)


@pytest.mark.parametrize(
    ("cls", "args"),
    [
        (MemoptDDPStrategy, []),
        (MemoptFSDPStrategy, []),
        (KNNRetrieval, []),
        (FaceVerification, []),
        (CombinedMarginLoss, []),
        (TopologicalAlignmentLoss, []),
        (SyntheticFaceDataModule, ["--init.image_size=32", "--init.batch_size=8"]),  # **kwargs: the base's arguments
        (SyntheticNormalsDataModule, ["--init.image_size=[32, 24]"]),
        (FaceRecognitionModule, TINY_FACE_MODULE),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
def test_defaults_parse_and_instantiate(cls, args):
    assert isinstance(build(cls, args), cls)


# (class, argument, a name it takes, what the object then holds, a name it refuses, the choices listed)
LITERALS = [
    (AdaptiveAccumulation, "loss_reduction", "sum", ("loss_reduction", "sum"), "median", ["mean", "sum"]),
    (PrecisionSwitch, "precision", "bf16-mixed", ("precision", "bf16-mixed"), "bf17-mixed", ["32-true", "16-mixed"]),
    (PrecisionSwitch, "precision", "16", ("precision", "16-mixed"), "8", ["auto", "bf16-mixed"]),
    (MemoryBudget, "gpu", "a100_80gb", ("hardware_name", "a100_80gb"), "a100", ["a100_40gb", "h100_80gb"]),
    (MemoptDDPStrategy, "comm_hook", "powersgd", ("comm_hook_name", "powersgd"), "int8", ["fp16", "bf16"]),
    (MemoptFSDPStrategy, "param_dtype", "bf16", ("param_dtype", "bf16"), "fp8", ["auto", "fp16", "fp32"]),
    (KNNRetrieval, "metric", "euclidean", ("metric", "euclidean"), "manhattan", ["cosine", "euclidean"]),
    (TopologicalAlignmentLoss, "variant", "symmetric", ("variant", "symmetric"), "persistent", ["diagram"]),
]


@pytest.mark.parametrize(("cls", "argument", "good", "held", "bad", "choices"), LITERALS, ids=lambda v: str(v))
def test_a_literal_takes_its_names_and_refuses_others_listing_them(cls, argument, good, held, bad, choices):
    built = build(cls, [f"--init.{argument}={good}"])
    assert getattr(built, held[0]) == held[1]
    message = refused(cls, [f"--init.{argument}={bad}"])
    assert bad in message or argument in message
    for choice in choices:
        assert repr(choice) in message, f"{choice!r} is not listed in: {message}"


@pytest.mark.parametrize(
    ("argument", "good", "bad", "choices"),
    [
        ("optimizer", "adamw", "adam", ["sgd", "adamw"]),
        ("schedule", "cosine", "linear", ["polynomial", "cosine", "constant"]),
        ("topo_variant", "symmetric", "persistent", ["diagram", "symmetric"]),
    ],
)
def test_task_literals(argument, good, bad, choices):
    module = build(FaceRecognitionModule, [*TINY_FACE_MODULE, f"--init.{argument}={good}"])
    assert module.hparams[argument] == good
    message = refused(FaceRecognitionModule, [*TINY_FACE_MODULE, f"--init.{argument}={bad}"])
    assert all(repr(choice) in message for choice in choices), message


def test_structured_arguments_parse():
    switch = build(PrecisionSwitch, ["--init.schedule={0: 32-true, 10: bf16-mixed}", "--init.schedule_interval=epoch"])
    assert (switch.schedule.at(9), switch.schedule.at(10), switch.schedule.interval) == (
        "32-true",
        "bf16-mixed",
        "epoch",
    )
    switch = build(PrecisionSwitch, ["--init.schedule=[[0, 32], {start: 5, end: 8, precision: bf16}]"])
    assert [entry.precision for entry in switch.schedule.entries] == ["32-true", "bf16-mixed"]
    budget = build(MemoryBudget, ["--init.knobs={precision: bf16-mixed, checkpoint: full, every_n: 2}"])
    assert budget.knobs.describe() == "bf16-mixed, full every 2"
    policy = build(ActivationCheckpointing, ["--init.policy=[fnet, {modules: backbone.*, mode: offload}]"])
    assert [p.describe() for p in policy.policies] == ["full(fnet)", "offload(backbone.*)"]
    assert build(ActivationCheckpointing, ["--init.policy=selective"]).policies[0].mode == "selective"
    fsdp = build(MemoptFSDPStrategy, ["--init.blocks=[torch.nn.Linear]", "--init.cpu_offload=true"])
    assert (fsdp.blocks, fsdp.cpu_offload) == (["torch.nn.Linear"], True)


def test_structured_arguments_refuse_bad_names_listing_the_choices():
    message = refused(PrecisionSwitch, ["--init.schedule_interval=batch"])
    assert "'step'" in message and "'epoch'" in message
    message = refused(MemoryBudget, ["--init.knobs={checkpoint: everything}"])
    assert all(repr(mode) in message for mode in ("none", "selective", "full", "offload")), message
    assert "bogus" in refused(MemoryBudget, ["--init.knobs={bogus: 1}"])


def test_help_lists_the_choices_and_the_argument_docs():
    text = parser_for(PrecisionSwitch).format_help()
    assert "{step,epoch}" in text  # a Literal alone is shown as argparse's choices
    assert "'bf16-mixed'" in text and "'auto'" in text
    assert "consecutive non-finite steps before stepping down" in text  # the Args: text is the help
    assert "{none,allreduce,fp16,bf16,powersgd}" in parser_for(MemoptDDPStrategy).format_help()
