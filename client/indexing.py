"""Turn a `tensor[...]` index (ints and step-1 slices) into a box plus the dims ints drop."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardserve.core.metadata import Box


def _as_int(value: Any) -> int | None:
    """`value` as an int when it is one (numpy/torch integer scalars too), else None."""
    if isinstance(value, bool) or getattr(
        value, "ndim", None
    ):  # a 1-element tensor is advanced indexing
        return None
    if getattr(value, "dtype", None) in (
        torch.bool,
        np.bool_,
    ):  # a 0-d bool tensor is a mask, not 0 or 1
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _one_dim(item: Any, dim: int, size: int) -> tuple[int, int, bool]:
    """(offset, length, dropped) of one index item in a dim of `size`."""
    index = _as_int(item)
    if index is not None:
        if not -size <= index < size:
            raise IndexError(f"index {index} is out of range for dim {dim} of size {size}")
        return index % size if size else 0, 1, True
    if isinstance(item, slice):
        if item.step is not None and _as_int(item.step) != 1:
            raise ValueError(
                f"index for dim {dim}: only slices with step 1 are supported, got step {item.step!r}"
            )
        for name in ("start", "stop"):
            bound = getattr(item, name)
            if bound is not None and _as_int(bound) is None:
                raise ValueError(f"index for dim {dim}: slice {name} must be an int, got {bound!r}")
        start, stop, _ = slice(
            _as_int(item.start) if item.start is not None else None,
            _as_int(item.stop) if item.stop is not None else None,
        ).indices(size)
        return start, max(stop - start, 0), False
    raise ValueError(
        f"index for dim {dim}: only ints and slices (step 1) are supported, "
        f"got {type(item).__name__}"
    )


def parse_index(index: Any, shape: Sequence[int]) -> tuple[Box, tuple[int, ...]]:
    """The box a `tensor[index]` reads and the dims to drop from it (one per int), like torch."""
    items = index if isinstance(index, tuple) else (index,)
    ellipses = [i for i, item in enumerate(items) if item is Ellipsis]
    if len(ellipses) > 1:
        raise ValueError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = ellipses[0]
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(f"too many indices: {len(items)} for a tensor of {len(shape)} dims")
    items = items + (slice(None),) * (len(shape) - len(items))
    offsets, sizes, dropped = [], [], []
    for dim, (item, size) in enumerate(zip(items, shape)):
        offset, length, drop = _one_dim(item, dim, size)
        offsets.append(offset)
        sizes.append(length)
        if drop:
            dropped.append(dim)
    return Box(tuple(offsets), tuple(sizes)), tuple(dropped)
