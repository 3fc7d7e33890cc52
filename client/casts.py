"""Casts in flight at the client's edge: a put's `dtype=` checked, and each tensor's stored dtype or read cast
allowed or refused (shardcore.casts) as INVALID_ARGUMENT naming the tensor's key."""

from __future__ import annotations

import torch

from shardserve.client.errors import InvalidArgumentError
from shardserve.core.casts import CastError, cast_target, read_cast_problem, stored_dtype


def put_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A put's `dtype=`: None (store every tensor as it is) or a floating dtype; InvalidArgumentError naming
    `dtype` otherwise."""
    if dtype is None:
        return None
    try:
        return cast_target(dtype)
    except CastError as err:
        raise InvalidArgumentError(f"dtype: {err}") from None


def stored_as(source: torch.dtype, wanted: torch.dtype | None, key: str) -> torch.dtype:
    """The dtype the tensor `key` of dtype `source` is stored as by a put asking for `wanted`; integer and bool
    tensors keep theirs; InvalidArgumentError naming the key for a cast that makes no sense."""
    try:
        return stored_dtype(source, wanted)
    except CastError as err:
        raise InvalidArgumentError(f"{key!r}: {err}") from None


def check_read_cast(stored: torch.dtype, out: torch.dtype, key: str) -> None:
    """InvalidArgumentError naming the key unless the tensor `key` stored as `stored` reads into `out`'s dtype."""
    problem = read_cast_problem(stored, out)
    if problem:
        raise InvalidArgumentError(
            f"{key!r} is {stored} in the snapshot, {out} in `into`: it cannot be read into it ({problem})"
        )
