"""The caller's ids and bag arguments, checked and made plain: 1-D int64 CPU ids, bag requests, row updates.

Errors name the argument (as nn.Embedding / nn.EmbeddingBag would), before any call is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardserve.client.arguments import dense_tensor
from shardserve.client.embedding.views import TableView
from shardserve.client.errors import InvalidArgumentError
from shardserve.core.embedding import validate_ids
from shardserve.core.routing import unique_ids

POOLINGS = ("auto", "server", "client")


@dataclass
class BagRequest:
    """A lookup_bag request of one table, checked."""

    ids: torch.Tensor
    offsets: torch.Tensor
    mode: str
    weights: torch.Tensor | None


def as_ids(ids: Any, field_name: str = "ids") -> torch.Tensor:
    """1-D int64 CPU ids from a tensor, a numpy array or a sequence of ints; InvalidArgumentError/TypeError name
    the field."""
    if isinstance(ids, torch.Tensor):
        return _checked_ids(ids, field_name).to("cpu", torch.int64).contiguous()
    if isinstance(
        ids, (str, bytes, bytearray, dict, set, frozenset)
    ):  # unordered, or not ids at all
        raise TypeError(
            f"{field_name} must be a tensor or a sequence of ints, got {type(ids).__name__}"
        )
    try:
        array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{field_name} must be a tensor or a sequence of ints: {err}") from None
    if (
        array.size and array.dtype.kind not in "iu"
    ):  # floats are not cut to ints, nor bools taken for 0 and 1
        raise TypeError(f"{field_name} must hold integers, got {array.dtype} values")
    if array.ndim != 1:
        raise InvalidArgumentError(f"{field_name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "u" and array.size and int(array.max()) >= 1 << 63:
        raise InvalidArgumentError(
            f"{field_name} holds {int(array.max())}, past the int64 range of row ids"
        )
    return torch.from_numpy(array.astype(np.int64))


def as_device_ids(ids: torch.Tensor, field_name: str = "ids") -> torch.Tensor:
    """1-D int64 ids on the device of tensor `ids` (no copy to the host), checked as as_ids checks them."""
    return _checked_ids(ids, field_name).to(torch.int64).contiguous()


def _checked_ids(ids: torch.Tensor, field_name: str) -> torch.Tensor:
    """`ids` detached, once checked to be a dense 1-D tensor of integers in the int64 range."""
    dense_tensor(ids, field_name)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{field_name} must hold integers, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidArgumentError(f"{field_name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype == torch.uint64 and bool(
        (ids.view(torch.int64) < 0).any()
    ):  # 2**63 and up, seen as int64
        raise InvalidArgumentError(
            f"{field_name} holds values of 2**63 or more, past the int64 range of row ids"
        )
    return ids.detach()


def check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")


def bag_request(
    ids: torch.Tensor, offsets: torch.Tensor, mode: str, weights: torch.Tensor | None
) -> BagRequest:
    """Check bag arguments the way nn.EmbeddingBag does; errors name the argument. The weights go to the ids'
    device."""
    if mode not in ("sum", "mean"):
        raise InvalidArgumentError(f"mode must be 'sum' or 'mean', got {mode!r}")
    if offsets.numel():
        if int(offsets[0]) != 0:
            raise InvalidArgumentError(f"offsets[0] has to be 0, got {int(offsets[0])}")
        if bool((torch.diff(offsets) < 0).any()) or int(offsets[-1]) > ids.numel():
            raise InvalidArgumentError(
                f"offsets must be non-decreasing and at most len(ids)={ids.numel()}"
            )
    if weights is not None:
        if mode != "sum":
            raise InvalidArgumentError(
                f"per_sample_weights is only supported for mode='sum', got mode={mode!r}"
            )
        if not isinstance(weights, torch.Tensor) or weights.shape != (ids.numel(),):
            shape = (
                tuple(weights.shape)
                if isinstance(weights, torch.Tensor)
                else type(weights).__name__
            )
            raise InvalidArgumentError(
                f"per_sample_weights must have shape ({ids.numel()},), got {shape}"
            )
        weights = dense_tensor(weights, "per_sample_weights").detach().to(ids.device).contiguous()
    return BagRequest(ids, offsets, mode, weights)


def validate_update(view: TableView, ids: Any, values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids and their rows for update_rows: duplicates keep the LAST value given (as assignment)."""
    ids = as_ids(ids)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    dense_tensor(values, "values")
    if not torch.can_cast(values.dtype, view.dtype):
        raise TypeError(
            f"values has dtype {values.dtype}, which table {view.name!r} ({view.dtype}) cannot hold "
            f"without losing its kind (torch.can_cast)"
        )
    if values.shape != (ids.numel(), view.dim):
        raise InvalidArgumentError(
            f"values has shape {tuple(values.shape)}; expected ({ids.numel()}, {view.dim})"
        )
    try:
        validate_ids(ids, view.summary.metadata.size[0], "error")
    except ValueError as err:
        raise InvalidArgumentError(f"ids: {err}") from None
    unique, inverse = unique_ids(ids)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(ids.numel(), dtype=torch.int64), reduce="amax")
    return unique, values.detach().cpu().to(view.dtype)[last].contiguous()
