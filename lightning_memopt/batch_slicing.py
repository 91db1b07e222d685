"""Cut a batch into micro-batches along the batch dimension, and merge the micro-batches' outputs.

Tensors are sliced as views (nothing is copied). Tuples, lists, named tuples, dicts and dataclasses
are walked; a list of plain values (strings, numbers) as long as the batch is sliced with it; other
plain values (an int, a string, ``None``) are shared by every micro-batch. Other types are taught
with :func:`register_batch_type`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

_PLAIN = (str, bytes, int, float, bool, type(None))
# type -> (size(batch) -> int, slice(batch, start, stop) -> batch)
_CUSTOM: dict[type, tuple[Callable[[Any], int], Callable[[Any, int, int], Any]]] = {}


class BatchSplitError(TypeError):
    """A batch that cannot be cut into micro-batches."""


def register_batch_type(
    cls: type,
    *,
    size: Callable[[Any], int],
    slice: Callable[[Any, int, int], Any],  # noqa: A002
) -> None:
    """Teach :func:`batch_size` and :func:`slice_batch` a custom batch type (subclasses included).

    Args:
        cls: the batch type.
        size: ``size(batch) -> int``, the number of samples.
        slice: ``slice(batch, start, stop) -> batch`` with samples ``start:stop``.

    Example::

        >>> class Clip:
        ...     def __init__(self, frames): self.frames = frames
        >>> register_batch_type(Clip, size=lambda c: c.frames.shape[1],
        ...                     slice=lambda c, a, b: Clip(c.frames[:, a:b]))
        >>> batch_size(Clip(torch.zeros(8, 6, 3)))
        6
        >>> slice_batch(Clip(torch.zeros(8, 6, 3)), 0, 2).frames.shape
        torch.Size([8, 2, 3])
    """
    if not isinstance(cls, type):
        raise TypeError(f"`cls`={cls!r} must be a type")
    for name, function in (("size", size), ("slice", slice)):
        if not callable(function):
            raise TypeError(f"`{name}`={function!r} must be a function")
    _CUSTOM[cls] = (size, slice)


def _custom(batch: Any) -> tuple[Callable[[Any], int], Callable[[Any, int, int], Any]] | None:
    for cls in type(batch).__mro__:
        if cls in _CUSTOM:
            return _CUSTOM[cls]
    return None


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension its tensors share.

    Raises:
        BatchSplitError: when the batch holds no tensor, its tensors disagree on the first
            dimension, or it holds a type nobody taught :func:`register_batch_type`.

    Example::

        >>> batch_size({"image": torch.zeros(4, 3, 8, 8), "label": torch.zeros(4), "name": "synthetic"})
        4
    """
    sizes: list[tuple[str, int]] = []
    _collect_sizes(batch, "batch", sizes)
    if not sizes:
        raise BatchSplitError(
            f"the batch ({type(batch).__name__}) holds no tensor to split; register its type with "
            "lightning_memopt.accumulation.register_batch_type"
        )
    first_path, first = sizes[0]
    for path, size in sizes[1:]:
        if size != first:
            raise BatchSplitError(
                f"the batch's tensors disagree on the batch dimension: {first_path} has {first} samples, "
                f"{path} has {size}"
            )
    return first


def _collect_sizes(batch: Any, path: str, sizes: list[tuple[str, int]]) -> None:
    custom = _custom(batch)
    if custom is not None:
        sizes.append((path, int(custom[0](batch))))
    elif isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise BatchSplitError(f"{path} is a 0-dimensional tensor: it has no batch dimension to split")
        sizes.append((f"{path} {list(batch.shape)}", batch.shape[0]))
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            _collect_sizes(value, f"{path}[{key!r}]", sizes)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for item in dataclasses.fields(batch):
            _collect_sizes(getattr(batch, item.name), f"{path}.{item.name}", sizes)
    elif isinstance(batch, Sequence) and not isinstance(batch, _PLAIN):
        if batch and all(isinstance(item, _PLAIN) for item in batch):
            return  # a list of names or numbers follows the tensors' batch dimension
        for index, value in enumerate(batch):
            _collect_sizes(value, f"{path}[{index}]", sizes)
    elif not isinstance(batch, _PLAIN):
        raise BatchSplitError(
            f"cannot split {path} of type {type(batch).__name__} into micro-batches; teach it with "
            f"lightning_memopt.accumulation.register_batch_type({type(batch).__name__}, size=..., slice=...)"
        )


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch``, with the same structure (tensors as views).

    Example::

        >>> images, labels = slice_batch((torch.arange(12).view(6, 2), [f"img{i}" for i in range(6)]), 2, 4)
        >>> images.tolist(), labels
        ([[4, 5], [6, 7]], ['img2', 'img3'])
    """
    total = batch_size(batch)
    if not 0 <= start < stop <= total:
        raise ValueError(f"samples {start}:{stop} are not a non-empty range of a batch of {total}")
    return _slice(batch, start, stop, total)


def _slice(batch: Any, start: int, stop: int, total: int) -> Any:
    custom = _custom(batch)
    if custom is not None:
        return custom[1](batch, start, stop)
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({key: _slice(value, start, stop, total) for key, value in batch.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            item.name: _slice(getattr(batch, item.name), start, stop, total)
            for item in dataclasses.fields(batch)
            if item.init
        }
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, Sequence) and not isinstance(batch, _PLAIN):
        if batch and all(isinstance(item, _PLAIN) for item in batch):
            return batch[start:stop] if len(batch) == total else batch
        items = [_slice(value, start, stop, total) for value in batch]
        return type(batch)(*items) if _is_namedtuple(batch) else type(batch)(items)  # type: ignore[call-arg]
    return batch


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """Merge the outputs of consecutive micro-batches of ``sizes`` samples into the whole batch's output.

    Tensors with a first dimension equal to their micro-batch's size are concatenated;
    0-dimensional tensors and numbers (a loss, an accuracy) become their mean weighted by the
    micro-batch sizes; lists of plain values as long as their micro-batch are concatenated;
    dicts, tuples, lists and dataclasses are merged field by field; ``None`` stays ``None``.

    Raises:
        BatchSplitError: for outputs of different structure, or of a type it cannot merge.

    Example::

        >>> merged = merge_outputs([{"pred": torch.ones(2), "loss": torch.tensor(1.0)},
        ...                         {"pred": torch.zeros(1), "loss": torch.tensor(4.0)}], [2, 1])
        >>> merged["pred"].tolist(), merged["loss"].item()
        ([1.0, 1.0, 0.0], 2.0)
    """
    if len(outputs) != len(sizes) or not outputs:
        raise ValueError(f"{len(outputs)} outputs for {len(sizes)} micro-batch sizes")
    if len(outputs) == 1:
        return outputs[0]
    return _merge(list(outputs), list(sizes), "output")


def _merge(outputs: list[Any], sizes: list[int], path: str) -> Any:
    first = outputs[0]
    if any(type(output) is not type(first) for output in outputs):
        kinds = sorted({type(output).__name__ for output in outputs})
        raise BatchSplitError(f"micro-batches returned different types at {path}: {', '.join(kinds)}")
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return _weighted_mean(outputs, sizes)
        if all(output.dim() > 0 and output.shape[0] == size for output, size in zip(outputs, sizes, strict=True)):
            return torch.cat(outputs)
        shapes = [list(output.shape) for output in outputs]
        raise BatchSplitError(
            f"cannot merge {path}: tensors of shapes {shapes} neither follow the micro-batch sizes {sizes} "
            "nor are scalars"
        )
    if isinstance(first, bool | int | float):
        return sum(float(output) * size for output, size in zip(outputs, sizes, strict=True)) / sum(sizes)
    if isinstance(first, Mapping):
        keys = list(first)
        if any(list(output) != keys for output in outputs):
            raise BatchSplitError(f"micro-batches returned different keys at {path}")
        return type(first)({key: _merge([o[key] for o in outputs], sizes, f"{path}[{key!r}]") for key in keys})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        changes = {
            item.name: _merge([getattr(o, item.name) for o in outputs], sizes, f"{path}.{item.name}")
            for item in dataclasses.fields(first)
            if item.init
        }
        return dataclasses.replace(first, **changes)
    if isinstance(first, Sequence) and not isinstance(first, str | bytes):
        if all(
            len(o) == size and all(isinstance(v, _PLAIN) for v in o) for o, size in zip(outputs, sizes, strict=True)
        ):
            return type(first)(value for output in outputs for value in output)  # type: ignore[call-arg]
        if any(len(output) != len(first) for output in outputs):
            raise BatchSplitError(f"micro-batches returned sequences of different lengths at {path}")
        items = [_merge([o[i] for o in outputs], sizes, f"{path}[{i}]") for i in range(len(first))]
        return type(first)(*items) if _is_namedtuple(first) else type(first)(items)  # type: ignore[call-arg]
    if all(output == first for output in outputs):
        return first  # the same plain value from every micro-batch (a name, a flag)
    raise BatchSplitError(
        f"cannot merge {path} of type {type(first).__name__} from several micro-batches; return tensors, "
        "numbers or containers of them"
    )


def _weighted_mean(values: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    dtype = values[0].dtype if values[0].is_floating_point() else torch.get_default_dtype()
    total = sum(value.to(dtype) * size for value, size in zip(values, sizes, strict=True))
    return total / sum(sizes)  # type: ignore[return-value]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a step's output: the output itself when a tensor, its ``"loss"`` when a mapping, else ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return None


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """``output`` (a loss tensor or a mapping with ``"loss"``) with ``loss`` as its loss.

    Example::

        >>> with_loss({"loss": torch.tensor(1.0), "n": 3}, torch.tensor(2.0))
        {'loss': tensor(2.), 'n': 3}
    """
    if isinstance(output, torch.Tensor):
        return loss
    return type(output)({**output, "loss": loss})


def batch_size_or_none(batch: Any) -> int | None:
    """:func:`batch_size`, or ``None`` for a batch that cannot be split (it runs whole).

    Example::

        >>> batch_size_or_none(torch.zeros(5, 2)), batch_size_or_none(object())
        (5, None)
    """
    try:
        return batch_size(batch)
    except BatchSplitError:
        return None  # it runs whole; only an out-of-memory error on it is an error
