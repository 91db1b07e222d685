"""What profile_step runs: the module (real, or a fake copy), its training step and its optimizer.

Example::

    >>> model = materialise(lambda: nn.Linear(4, 2), FakeTensorMode())
    >>> from lightning_memopt.private_api import is_fake
    >>> is_fake(model.weight), device_of(model).type
    (True, 'cpu')
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory.compiled import uncompiled_copy
from lightning_memopt.private_api import FakeTensorMode, attach_trainer, attached_trainer, tree_map

ModelSource = nn.Module | Callable[[], nn.Module]
OptimizerSource = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def create_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def materialise(model: ModelSource, fake_mode: FakeTensorMode | None) -> nn.Module:
    """The module to profile: the module itself, built from a factory, or a fake copy of either.

    In fake mode a factory runs on the meta device (initialisation is free there) and every
    parameter and buffer is swapped for a fake tensor of the same shape on the CPU (or on the
    module's own device), so nothing is allocated and no data-dependent init op runs.
    """
    if fake_mode is None:
        return model if isinstance(model, nn.Module) else model()
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model()
    memo: dict[int, Any] = {}
    with fake_mode:
        for tensor in [*model.parameters(), *model.buffers()]:
            device = "cpu" if tensor.device.type == "meta" else tensor.device
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    trainer = attached_trainer(model)
    if trainer is not None:
        memo[id(trainer)] = None
    return uncompiled_copy(model, memo)


def is_lightning_module(module: nn.Module) -> bool:
    return callable(getattr(module, "training_step", None)) and callable(getattr(module, "configure_optimizers", None))


def training_step_fn(module: nn.Module, loss_fn: LossFn | None) -> Callable[[Any], torch.Tensor]:
    if loss_fn is not None:
        return lambda batch: loss_fn(module, batch)
    if not is_lightning_module(module):
        raise ValueError(
            f"`loss_fn` is needed to profile a plain {type(module).__name__}; pass "
            "`loss_fn=lambda model, batch: ...` or a LightningModule"
        )

    def lightning_step(batch: Any) -> torch.Tensor:
        output = module.training_step(batch, 0)  # type: ignore[operator]
        return output["loss"] if isinstance(output, dict) else output

    return lightning_step


def build_optimizer(module: nn.Module, source: OptimizerSource | None, fake_mode: FakeTensorMode | None) -> Any:
    if source is None:
        if not is_lightning_module(module):
            raise ValueError(f"`optimizer` is needed to profile a plain {type(module).__name__}")
        return lightning_optimizer(module)
    if isinstance(source, torch.optim.Optimizer):
        if fake_mode is None:
            return source
        # the same optimizer class and groups, over the fake parameters (matched by position)
        fake_params = list(module.parameters())
        real_index = {id(p): i for i, p in enumerate(p for g in source.param_groups for p in g["params"])}
        groups = [{**g, "params": [fake_params[real_index[id(p)]] for p in g["params"]]} for g in source.param_groups]
        return type(source)(groups)  # type: ignore[call-arg]
    return source(module.parameters())


def lightning_optimizer(module: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of a LightningModule's ``configure_optimizers``, outside any fit."""
    from lightning.pytorch import Trainer

    previous = attached_trainer(module)
    quiet = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    with silent_lightning():  # a plan builds one per profile: its "GPU available", tips, … would repeat each time
        attach_trainer(module, Trainer(accelerator="cpu", max_epochs=-1, max_steps=1000, **quiet))
    try:
        config = module.configure_optimizers()
    finally:
        attach_trainer(module, previous)
    while isinstance(config, list | tuple):
        config = config[0]
    if isinstance(config, dict):
        config = config["optimizer"]
    if not isinstance(config, torch.optim.Optimizer):
        raise ValueError(f"configure_optimizers of {type(module).__name__} gave no optimizer: {config!r}")
    return config


def device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, batch)
    return found


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.WARNING) -> Iterator[None]:
    """The logger ``name`` (and its children) says only ``level`` and above while the block runs."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def silent_lightning() -> Iterator[None]:
    """Lightning's informational lines and warnings off while the block runs (a Trainer built for a profile).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> with silent_lightning():
        ...     trainer = Trainer(accelerator="cpu", logger=False)  # prints nothing
    """
    with quiet_logger("lightning.pytorch", logging.ERROR), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def quiet_logging() -> Iterator[None]:
    # a LightningModule's self.log() outside a Trainer warns on every call
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")
        yield
