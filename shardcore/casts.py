"""Which dtype casts a put or a read makes in flight: floating tensors convert between floating dtypes as torch's
`copy_` converts them (bit for bit `src.to(dtype)`); integer and bool tensors are never cast; anything else
(to or from a complex, to an integer, a dtype shardserve does not carry) is refused."""

from __future__ import annotations

import torch

from shardserve.core.dtypes import SUPPORTED_DTYPES, dtype_from_name


class CastError(ValueError):
    """A cast that a put or a read must not make, with the reason."""


def castable(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` convert in flight (the floating dtypes shardserve carries)."""
    return dtype.is_floating_point and dtype in SUPPORTED_DTYPES


def cast_target(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype a put asks its floating tensors to be stored as; CastError unless it is a floating dtype that
    shardserve carries."""
    try:
        wanted = dtype_from_name(dtype)
    except (TypeError, ValueError) as err:
        raise CastError(str(err)) from None
    if not castable(wanted):
        floating = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES if castable(d))
        raise CastError(
            f"a put casts floating tensors only to a floating dtype ({floating}), not to {wanted}"
        )
    return wanted


def stored_dtype(source: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype `source` is stored as when a put asks for `wanted` (None: its own): floating
    tensors as `wanted`, integer and bool tensors as themselves; CastError for a complex tensor asked to become
    another dtype (torch would drop its imaginary part)."""
    if wanted is None or wanted == source or not (source.is_floating_point or source.is_complex):
        return source
    if not castable(source):
        raise CastError(f"a {source} tensor cannot be stored as {wanted}")
    return wanted


def read_cast_problem(stored: torch.dtype, out: torch.dtype) -> str:
    """Why a tensor stored as `stored` cannot be read into an output of dtype `out` ("" when it can: the same
    dtype, or two floating dtypes, converted while copying)."""
    if stored == out or (castable(stored) and castable(out)):
        return ""
    return "only floating dtypes convert while reading"
