"""PrecisionSwitch: pick the precision for the device, change it on a schedule, step down when it fails."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.arguments import check_float, check_int, check_optional_bool
from lightning_memopt.callbacks.module_hooks import after_configure_model
from lightning_memopt.precision import (
    PrecisionSchedule,
    SwitchablePrecision,
    apply_fp32_islands,
    auto_precision,
    mantissa_bits,
    normalise_precision,
    remove_fp32_islands,
    supports_bf16,
)
from lightning_memopt.precision.schedule import PrecisionScheduleSpec, ScheduleInterval, check_interval
from lightning_memopt.selection import ModuleSpec, normalise_specs
from lightning_memopt.strategies import MemoptFSDPStrategy
from lightning_memopt.vocabulary import PrecisionSetting


class PrecisionSwitch(Callback):
    """Mixed precision chosen for the device, scheduled, fail-safe, with fp32 islands.

    Installs :class:`~lightning_memopt.precision.SwitchablePrecision` as the Trainer's precision
    plugin (leave ``Trainer(precision=...)`` at its default). Switches happen between optimizer
    steps, at the start of an accumulation window; under DDP and ``fsdp_memopt`` every rank
    switches at the same step, and a non-finite value on any rank makes every rank skip the step.
    Under ``fsdp_memopt`` the units are gathered in fp32 as stored, autocast computes in the
    precision of the moment, the fail-safe checks each rank's gradient shards, and 16-mixed's
    gradient scaler finds an overflow in any rank's shards on every rank (DTensor reduces its check).
    ``memopt/precision`` logs the compute dtype's mantissa bits each step (23 = 32-true,
    7 = bf16-mixed, 10 = 16-mixed) and ``memopt/skipped_steps`` the steps the fail-safe skipped.

    Args:
        precision: ``"auto"`` (bf16-mixed on CPUs and CUDA ≥ 8.0, 16-mixed on CUDA 7.x, 32-true
            elsewhere), or ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` (and Lightning's
            aliases 32, 16, "bf16"): the precision wherever the schedule says nothing.
        schedule: ``{start: precision}`` or a list of ``[start, precision]`` pairs and
            ``{start, end, precision}`` mappings (a precision there may be ``"auto"`` too); see
            :class:`~lightning_memopt.precision.PrecisionSchedule`. ``None``: no schedule.
        schedule_interval: ``"step"`` (optimizer steps) or ``"epoch"``.
        fail_safe: skip optimizer steps with a non-finite loss or gradient and step down
            16-mixed → bf16-mixed → 32-true after ``patience`` in a row, or when the fp16 loss scale
            falls below ``min_loss_scale``. ``None``: on for ``precision="auto"``, off otherwise.
            The words ``"on"`` / ``"off"`` (``"true"``, ``"yes"``, ``"1"`` / ``"false"``, ``"no"``,
            ``"0"``) are read as such; anything else is refused.
        patience: consecutive non-finite steps before stepping down.
        min_loss_scale: the fp16 loss scale below which the run steps down.
        fp32_modules: submodules to run as fp32 islands (classes, dotted paths, name globs), or
            ``"preset"`` for the islands the model declares (the margin head and the normal-head output conv);
            ``None``: no islands.

    Raises:
        MisconfigurationException: a bad argument (in ``__init__``); in ``setup``, a Trainer with
            its own precision, a strategy other than single-device, DDP or ``fsdp_memopt`` (or that
            with a ``param_dtype`` of its own), bf16 on a device without it, or ``fp32_modules`` that
            match nothing.

    Example::

        >>> switch = PrecisionSwitch("auto", schedule={0: "32-true", 500: "bf16-mixed"})
        >>> switch.schedule.at(500), switch.fail_safe
        ('bf16-mixed', True)
    """

    def __init__(
        self,
        precision: PrecisionSetting = "auto",
        schedule: PrecisionScheduleSpec | None = None,
        schedule_interval: ScheduleInterval = "step",
        fail_safe: bool | None = None,
        patience: int = 3,
        min_loss_scale: float = 1.0,
        fp32_modules: Literal["preset"] | ModuleSpec | Iterable[ModuleSpec] | None = None,
    ) -> None:
        try:
            self.precision = "auto" if precision == "auto" else normalise_precision(precision)
            check_interval(schedule_interval)
            self.schedule = PrecisionSchedule(schedule, schedule_interval) if schedule is not None else None
            checked_fail_safe = check_optional_bool("fail_safe", fail_safe)  # "off" is false, never truthiness
            self.patience = check_int("patience", patience, minimum=1)
            self.min_loss_scale = check_float("min_loss_scale", min_loss_scale, minimum=0, open_minimum=True)
            if fp32_modules is not None and fp32_modules != "preset":
                fp32_modules = normalise_specs(fp32_modules, "fp32_modules")
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"PrecisionSwitch: {error}") from None
        self.fail_safe = (self.precision == "auto") if checked_fail_safe is None else checked_fail_safe
        self.fp32_modules = fp32_modules
        self.plugin: SwitchablePrecision | None = None
        self.base_precision: str | None = None  # ``precision`` resolved for the device
        self.islands: list[str] = []
        self._position: int | None = None  # the schedule position last applied

    # ---------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SingleDeviceStrategy | DDPStrategy | MemoptFSDPStrategy):
            raise MisconfigurationException(
                "PrecisionSwitch works with single-device, DDP and fsdp_memopt strategies, not "
                f"{type(strategy).__name__}; give another sharded strategy its precision through its own plugin"
            )
        if isinstance(strategy, MemoptFSDPStrategy) and strategy.param_dtype not in ("auto", "fp32"):
            raise MisconfigurationException(
                f"PrecisionSwitch: MemoptFSDPStrategy(param_dtype={strategy.param_dtype!r}) would gather the units in "
                "that dtype whatever precision PrecisionSwitch chooses; leave `param_dtype` at 'auto' (gathered as "
                "stored, computed in the switched precision)"
            )
        current = strategy.precision_plugin
        if self.plugin is None or current is not self.plugin:
            if isinstance(current, SwitchablePrecision) or type(current) is not Precision:
                raise MisconfigurationException(
                    f"PrecisionSwitch: the Trainer already has `precision`={trainer.precision!r} "
                    f"({type(current).__name__}); leave Trainer(precision=...) at its default '32-true' and give "
                    f"the precision to PrecisionSwitch(precision=...), which is {self.precision!r}"
                )
            strategy.precision_plugin = self._build_plugin(trainer)
        if self.fp32_modules is not None:
            after_configure_model(pl_module, lambda: self._apply_islands(pl_module))

    def _build_plugin(self, trainer: Trainer) -> SwitchablePrecision:
        device = trainer.strategy.root_device
        if self.precision == "auto":
            precision, reason = auto_precision(device)
            precision, reason = trainer.strategy.broadcast((precision, reason))  # every rank runs rank 0's choice
        else:
            precision, reason = self.precision, "as configured"
        self._check_supported(precision, device)
        self.base_precision = precision
        start = self._scheduled(0) or precision
        self.plugin = SwitchablePrecision(start, device.type, self.fail_safe, self.patience, self.min_loss_scale)
        schedule = f"; schedule by {self.schedule.interval}: {self.schedule.describe()}" if self.schedule else ""
        safe = f"; fail-safe on (patience {self.patience})" if self.fail_safe else ""
        rank_zero_info(f"PrecisionSwitch: {precision} on {device.type} ({reason}){schedule}{safe}")
        return self.plugin

    def _check_supported(self, precision: str, device: torch.device) -> None:
        wanted = [precision, *(entry.precision for entry in self.schedule.entries)] if self.schedule else [precision]
        if "bf16-mixed" in wanted and not supports_bf16(device):
            raise MisconfigurationException(
                f"PrecisionSwitch: bf16-mixed is not native on {device} ({_describe_device(device)});"
                " use '16-mixed' or 'auto'"
            )

    def _apply_islands(self, pl_module: LightningModule) -> None:
        assert self.fp32_modules is not None
        try:
            self.islands = apply_fp32_islands(pl_module, self.fp32_modules)
        except ValueError as error:
            raise MisconfigurationException(f"PrecisionSwitch: {error}") from None
        if self.islands:
            rank_zero_info(f"PrecisionSwitch: fp32 islands: {', '.join(self.islands)}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        remove_fp32_islands(pl_module)

    # ---------------------------------------------------------------- schedule and logging
    def _scheduled(self, position: int) -> str | None:
        precision = self.schedule.at(position) if self.schedule is not None else None
        return self.base_precision if precision == "auto" else precision

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.plugin is None or batch_idx % trainer.accumulate_grad_batches:  # not between optimizer steps
            return
        position = (
            trainer.global_step if self.schedule is None or self.schedule.interval == "step" else trainer.current_epoch
        )
        self._position = position
        wanted = self._scheduled(position) or self.base_precision
        assert wanted is not None
        reason = f"scheduled from {self.schedule.interval} {position}" if self.schedule else "the configured precision"
        self.plugin.switch(wanted, reason, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.plugin is None or trainer.sanity_checking:
            return
        pl_module.log("memopt/precision", float(mantissa_bits(self.plugin.precision)), on_step=True, on_epoch=False)
        pl_module.log("memopt/skipped_steps", float(self.plugin.skipped_steps), on_step=True, on_epoch=False)

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "base_precision": self.base_precision,
            "schedule": self.schedule.describe() if self.schedule else None,
            "position": self._position,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("schedule")
        current = self.schedule.describe() if self.schedule else None
        if saved != current:
            rank_zero_warn(
                f"PrecisionSwitch: resuming with schedule {current!r}, the checkpoint was written under {saved!r}; "
                "the new schedule applies from the resumed step"
            )
        self._position = state_dict.get("position")
        if state_dict.get("base_precision") not in (None, self.base_precision):
            rank_zero_info(
                f"PrecisionSwitch: the checkpoint ran in {state_dict['base_precision']}; on this device "
                f"{self.precision!r} is {self.base_precision}"
            )


def _describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"compute capability {major}.{minor}"
