"""SwitchablePrecision: a Lightning precision plugin whose precision can change between optimizer steps.

Lightning fixes the precision when the Trainer is built. This plugin keeps the weights in fp32 and
moves between 32-true, bf16-mixed and 16-mixed (with a gradient scaler) at any optimizer-step
boundary. With the fail-safe on, every optimizer step first checks the loss and the gradients:
a non-finite value on any rank skips the step on every rank (the optimizer never sees it, and
buffers such as batch-norm statistics are put back), and ``patience`` such steps in a row, or an
fp16 loss scale fallen below ``min_loss_scale``, step the run down to a safer precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import LBFGS
from typing_extensions import override

from lightning_memopt.arguments import check_bool, check_float, check_int
from lightning_memopt.precision.resolve import AUTOCAST_DTYPES, step_down, supports_bf16
from lightning_memopt.private_api import copy_tensors, optimizer_handles_unscaling
from lightning_memopt.vocabulary import PRECISION_FALLBACK, PRECISIONS


class SwitchablePrecision(Precision):
    """A precision plugin that switches precision between optimizer steps, with an optional fail-safe.

    Args:
        precision: the starting precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        device: the device type autocast runs on (``"cuda"``, ``"cpu"``).
        fail_safe: skip optimizer steps with a non-finite loss or gradient, and step down the
            precision after ``patience`` of them in a row or when the fp16 loss scale collapses.
        patience: consecutive non-finite steps before stepping down. In 16-mixed a gradient
            overflow is the scaler's business (it skips the step and lowers the scale) and does
            not count; a non-finite loss does.
        min_loss_scale: in 16-mixed, step down when the scaler's scale falls below this.
        capability: the CUDA compute capability to assume instead of asking the device.

    Raises:
        ValueError: an unknown precision, ``patience`` < 1, ``min_loss_scale`` ≤ 0, or a ``fail_safe``
            neither a bool nor a word such as ``"on"`` / ``"off"``.
        TypeError: a ``patience`` or ``min_loss_scale`` that is no number.

    Example::

        >>> plugin = SwitchablePrecision("32-true", device="cpu", fail_safe=True)
        >>> plugin.switch("16-mixed", reason="scheduled", step=10)
        True
        >>> plugin.precision, type(plugin.scaler).__name__, plugin.history[-1]["reason"]
        ('16-mixed', 'GradScaler', 'scheduled')
    """

    def __init__(
        self,
        precision: str = "32-true",
        device: str = "cpu",
        fail_safe: bool = False,
        patience: int = 3,
        min_loss_scale: float = 1.0,
        capability: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(precision, str) or precision not in PRECISIONS:
            raise ValueError(f"Unknown `precision`={precision!r}; valid choices: {', '.join(PRECISIONS)}")
        self.device = device
        self.fail_safe = check_bool("fail_safe", fail_safe)
        self.patience = check_int("patience", patience, minimum=1)
        self.min_loss_scale = check_float("min_loss_scale", min_loss_scale, minimum=0, open_minimum=True)
        self.capability = capability
        self.precision = precision  # type: ignore[assignment]
        self.scaler: torch.amp.GradScaler | None = self._new_scaler() if precision == "16-mixed" else None
        self.floor: str | None = None  # the least safe precision the fail-safe still allows
        self.consecutive_nonfinite = 0
        self.skipped_steps = 0
        self.history: list[dict[str, Any]] = []
        self._model: torch.nn.Module | None = None
        # the model's buffers and their copies from before the first forward since the last optimizer step
        self._buffer_snapshot: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    # ---------------------------------------------------------------- switching
    def allowed(self, precision: str) -> str:
        """``precision``, or the fail-safe's floor where that is safer."""
        if self.floor is not None and PRECISION_FALLBACK.index(precision) < PRECISION_FALLBACK.index(self.floor):
            return self.floor
        return precision

    def switch(self, precision: str, reason: str, step: int) -> bool:
        """Run in ``precision`` from the next forward on (held to the fail-safe's floor); whether it changed."""
        precision = self.allowed(precision)
        if precision == self.precision:
            return False
        self.history.append({"step": step, "from": self.precision, "to": precision, "reason": reason})
        rank_zero_info(f"PrecisionSwitch: step {step}: {self.precision} → {precision} ({reason})")
        self.precision = precision  # type: ignore[assignment]
        self.scaler = self._new_scaler() if precision == "16-mixed" else None
        return True

    def _new_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device=self.device)

    @override
    def connect(self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, ...]:
        self._model = model  # whose buffers a skipped step puts back
        return super().connect(model, optimizers, lr_schedulers)

    # ---------------------------------------------------------------- autocast
    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        dtype = AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            yield
            return
        # no weight-cast cache: a cast made under no_grad would be reused where gradients are needed
        with torch.autocast(self.device, dtype=dtype, cache_enabled=False):
            yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self.fail_safe and self._buffer_snapshot is None:  # the first forward since the last optimizer step
            buffers = list(self._model.buffers()) if self._model is not None else []
            self._buffer_snapshot = (buffers, [buffer.clone() for buffer in buffers])
        with self.forward_context():
            yield

    # ---------------------------------------------------------------- backward and step
    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None and not self.fail_safe:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(
                "PrecisionSwitch: LBFGS re-evaluates its closure, which a gradient scaler or the fail-safe cannot "
                "check; use 32-true with `fail_safe=False`"
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # training_step returned None: no backward
            self._after_closure(model, optimizer)
            self._buffer_snapshot = None
            return None
        if self.scaler is not None and not optimizer_handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)
        loss_bad, grads_bad = self._nonfinite(model, optimizer, closure_result) if self.fail_safe else (False, False)
        self._after_closure(model, optimizer)
        if loss_bad or grads_bad:
            self._skip(optimizer)
            step_output = closure_result
        elif self.scaler is not None:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
        else:
            step_output = optimizer.step(**kwargs)
        self._buffer_snapshot = None
        if self.fail_safe:
            self._after_step(model, loss_bad, grads_bad)
        return step_output

    def _nonfinite(self, model: pl.LightningModule, optimizer: Any, loss: Any) -> tuple[bool, bool]:
        """Whether the loss, and the gradients, are non-finite on any rank.

        Each rank looks at the gradients it holds (its shards under FSDP) and the flags are summed
        over ranks, so every rank takes the same decision.
        """
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        strategy = model.trainer.strategy
        flags = torch.zeros(2, device=strategy.root_device)
        if isinstance(loss, torch.Tensor):
            flags[0] = (~torch.isfinite(loss.detach())).any()
        if grads:
            flags[1] = ~torch.isfinite(torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False))
        if model.trainer.world_size > 1:  # a non-finite value on one rank skips and switches every rank
            flags = strategy.reduce(flags, reduce_op="sum")
        loss_bad, grads_bad = (bool(flag) for flag in flags.tolist())
        return loss_bad, grads_bad

    def _skip(self, optimizer: Any) -> None:
        """Leave weights and optimizer state untouched; put the buffers back as they were before the forward."""
        if self.scaler is not None:
            self.scaler.update()  # counts the overflow recorded by unscale_: the scale backs off
        optimizer.zero_grad(set_to_none=True)
        if self._buffer_snapshot is not None and self._buffer_snapshot[0]:
            copy_tensors(*self._buffer_snapshot)
        self.skipped_steps += 1

    def _after_step(self, model: pl.LightningModule, loss_bad: bool, grads_bad: bool) -> None:
        counts = loss_bad or (grads_bad and self.scaler is None)  # fp16 overflows are the scaler's to handle
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if counts else 0
        step = model.trainer.global_step
        if self.consecutive_nonfinite >= self.patience:
            what = "loss" if loss_bad else "gradient norm"
            self._step_down(f"non-finite {what} in {self.consecutive_nonfinite} consecutive steps", step)
        elif self.scaler is not None and self.scaler.get_scale() < self.min_loss_scale:
            self._step_down(f"fp16 loss scale {self.scaler.get_scale():g} fell below {self.min_loss_scale:g}", step)

    def _step_down(self, reason: str, step: int) -> None:
        safer = step_down(self.precision, torch.device(self.device), self.capability)
        if safer is None:
            raise FloatingPointError(
                f"PrecisionSwitch: {reason} in 32-true, the safest precision, at step {step} "
                f"({self.skipped_steps} steps skipped so far): the cause is not precision; look at the learning "
                "rate, the data and the loss"
            )
        self.floor = safer
        self.consecutive_nonfinite = 0
        self.switch(safer, reason, step)

    # ---------------------------------------------------------------- clipping and state
    @override
    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        if clip_val > 0 and self.scaler is not None and optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales gradients inside its step, so they cannot be clipped in "
                "16-mixed; use an optimizer without `fused=True`"
            )
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        super().clip_gradients(optimizer, clip_val=clip_val, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "floor": self.floor,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "skipped_steps": self.skipped_steps,
            "history": list(self.history),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        precision = state_dict.get("precision", self.precision)
        if precision == "bf16-mixed" and not supports_bf16(torch.device(self.device), self.capability):
            precision = step_down(precision, torch.device(self.device), self.capability) or "32-true"
        self.floor = state_dict.get("floor")
        if self.floor == "bf16-mixed" and precision != "bf16-mixed":
            self.floor = precision
        self.precision = precision
        self.scaler = self._new_scaler() if precision == "16-mixed" else None
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.consecutive_nonfinite = state_dict.get("consecutive_nonfinite", 0)
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        self.history = list(state_dict.get("history", []))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP's sharded gradients), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
