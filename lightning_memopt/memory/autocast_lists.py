"""CUDA's autocast op lists, followed by a step that runs on the CPU: a profile that plans for a GPU.

CPU and CUDA autocast cast different ops. CUDA runs ``layer_norm``, ``group_norm``, ``softmax``,
``log_softmax``, ``sum``, ``exp``, ``pow``, the losses and norms in fp32 where the CPU leaves them in
bf16; the CPU runs ``grid_sampler``, 3-d pooling, reflection padding and linear algebra in fp32 where
CUDA leaves them as they come (or promotes to the widest input). The tensors a step keeps differ with
them: a bf16 step planned for a GPU must be profiled with CUDA's lists. :class:`CudaAutocastLists`
applies them above CPU autocast, by the function's name, as ``aten/src/ATen/autocast_mode.cpp`` (torch
2.x) casts:

- ``fp32``: floating inputs in lower precision are cast to fp32 (a copy, what autograd saves); ``normalize``
  too, whose inner ``norm`` CUDA runs in fp32 so that the division returns fp32 (the mode sees only the
  outermost function of a call);
- ``fp32_set_opt_dtype``: the op runs with ``dtype=torch.float32`` when none is given (no input copy);
- ``promote``: inputs cast to the widest floating dtype among them;
- ``lower_precision_fp`` ops that CPU autocast leaves alone: fp32 inputs cast to the autocast dtype;
- the rest of CPU autocast's fp32 list: run as they come, CPU autocast off, in a prediction (fake
  tensors; a real step on the CPU keeps them in fp32: the CPU has no bf16 kernel for most of them).

Autograd runs a backward without the function modes of its forward: a checkpointed block's
recomputation enters the lists again through :func:`under_lists_of_forward`.

Example::

    >>> import torch
    >>> x = torch.randn(4, 8)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastLists(torch.bfloat16):
    ...     hidden = torch.nn.functional.linear(x, torch.randn(8, 8))
    ...     normed = torch.nn.functional.layer_norm(hidden, (8,))
    >>> hidden.dtype, normed.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_memopt.private_api import active_function_modes, is_fake, tree_flatten, tree_map

# The Python names the ops of CUDA's lists are reached by (functional, torch, Tensor method and operator forms).
FP32 = frozenset(
    [
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "__pow__",
        "__rpow__",
        "softplus",
        "layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "cross_entropy",
        "normalize",
    ]
)
FP32_SET_DTYPE = frozenset(
    [
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "vector_norm",
        "matrix_norm",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_norm",
        "sum",
        "norm",
    ]
)
PROMOTE = frozenset(
    [
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "grid_sample",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    ]
)
LOWER_ON_CUDA_ONLY = frozenset(["addmv", "addr", "einsum", "mv", "chain_matmul", "multi_dot"])
FP32_ON_CPU_ONLY = frozenset(
    [
        "avg_pool3d",
        "max_pool3d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool3d",
        "max_unpool2d",
        "max_unpool3d",
        "pad",
        "polar",
        "quantile",
        "nanquantile",
        "stft",
        "trace",
        "view_as_complex",
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",
        "orgqr",
        "ormqr",
        "pinverse",
        "binary_cross_entropy",
        "ctc_loss",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
    ]
)
_LOWER = (torch.float16, torch.bfloat16)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class CudaAutocastLists(TorchFunctionMode):
    """Inside CPU autocast at ``dtype``, cast as CUDA autocast would (see the module's docstring)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not torch.is_autocast_enabled("cpu") or name not in _HANDLED:
            return func(*args, **kwargs)
        if kwargs.get("out") is not None or any(isinstance(arg, torch.dtype) for arg in args):
            return func(*args, **kwargs)  # CUDA autocasts neither `out=` forms nor a dtype given positionally
        if name in FP32:
            args, kwargs = _cast(args, kwargs, lambda t: t.dtype in _LOWER, torch.float32)
        elif name in FP32_SET_DTYPE:
            if kwargs.get("dtype") is None and any(t.dtype in _LOWER for t in _tensors(args, kwargs)):
                kwargs = {**kwargs, "dtype": torch.float32}
        elif name in PROMOTE:
            widest = max((t.dtype for t in _tensors(args, kwargs)), key=lambda d: torch.finfo(d).bits, default=None)
            if widest is not None:
                args, kwargs = _cast(args, kwargs, lambda t: t.dtype != widest, widest)
        elif name in LOWER_ON_CUDA_ONLY:
            args, kwargs = _cast(args, kwargs, lambda t: t.dtype == torch.float32, self.dtype)
        elif not any(is_fake(t) for t in _tensors(args, kwargs)):  # fp32 on the CPU only, in a real CPU step
            return func(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)


_HANDLED = FP32 | FP32_SET_DTYPE | PROMOTE | LOWER_ON_CUDA_ONLY | FP32_ON_CPU_ONLY


def active_lists() -> CudaAutocastLists | None:
    """The innermost :class:`CudaAutocastLists` active on this thread, if any."""
    return next((mode for mode in reversed(active_function_modes()) if isinstance(mode, CudaAutocastLists)), None)


def under_lists_of_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` under the lists active now, also when autograd calls it again in backward (a recomputation).

    Example::

        >>> run = under_lists_of_forward(lambda: active_lists())
        >>> run() is None
        True
    """
    lists = active_lists()
    if lists is None:
        return forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if active_lists() is lists:
            return forward(*args, **kwargs)
        with lists:
            return forward(*args, **kwargs)

    return run


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [value for value in tree_flatten((args, kwargs))[0] if _floating(value)]


def _cast(
    args: tuple[Any, ...], kwargs: dict[str, Any], which: Callable[[torch.Tensor], bool], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def cast(value: Any) -> Any:
        return value.to(dtype) if _floating(value) and which(value) else value

    return tree_map(cast, args), tree_map(cast, kwargs)
