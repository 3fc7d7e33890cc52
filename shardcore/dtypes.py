"""The one dtype table: torch dtype <-> wire enum value <-> name <-> item size."""

from __future__ import annotations

import torch

# (torch dtype, wire enum number as in protos/shardserve.proto DType, name)
_TABLE: tuple[tuple[torch.dtype, int, str], ...] = (
    (torch.float32, 1, "float32"),
    (torch.float64, 2, "float64"),
    (torch.float16, 3, "float16"),
    (torch.bfloat16, 4, "bfloat16"),
    (torch.int8, 5, "int8"),
    (torch.int16, 6, "int16"),
    (torch.int32, 7, "int32"),
    (torch.int64, 8, "int64"),
    (torch.uint8, 9, "uint8"),
    (torch.bool, 10, "bool"),
    (torch.complex64, 11, "complex64"),
    (torch.complex128, 12, "complex128"),
)

_BY_DTYPE = {dt: (num, name) for dt, num, name in _TABLE}
_BY_NUMBER = {num: dt for dt, num, _ in _TABLE}
_BY_NAME = {name: dt for dt, _, name in _TABLE}
_BY_NAME.update(
    {
        "float": torch.float32,
        "double": torch.float64,
        "half": torch.float16,
        "long": torch.int64,
        "int": torch.int32,
    }
)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(dt for dt, _, _ in _TABLE)


class UnsupportedDTypeError(ValueError):
    """A dtype (or its wire number or name) that shardserve does not carry."""


def dtype_to_wire(dtype: torch.dtype) -> int:
    """Wire enum number of a torch dtype."""
    try:
        return _BY_DTYPE[dtype][0]
    except KeyError:
        raise UnsupportedDTypeError(
            f"dtype {dtype} is not supported; supported: {dtype_names()}"
        ) from None


def dtype_from_wire(number: int) -> torch.dtype:
    """Torch dtype of a wire enum number; raises UnsupportedDTypeError for 0 or unknown."""
    try:
        return _BY_NUMBER[int(number)]
    except KeyError:
        raise UnsupportedDTypeError(f"dtype enum value {number} is not a supported dtype") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Short name ("float32") of a torch dtype."""
    try:
        return _BY_DTYPE[dtype][1]
    except KeyError:
        raise UnsupportedDTypeError(
            f"dtype {dtype} is not supported; supported: {dtype_names()}"
        ) from None


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Torch dtype from a name ("float32", "torch.float32") or a dtype itself."""
    if isinstance(name, torch.dtype):
        dtype_to_wire(name)
        return name
    key = str(name).removeprefix("torch.")
    try:
        return _BY_NAME[key]
    except KeyError:
        raise UnsupportedDTypeError(
            f"unknown dtype name {name!r}; supported: {dtype_names()}"
        ) from None


def dtype_names() -> str:
    return ", ".join(name for _, _, name in _TABLE)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    dtype_to_wire(dtype)
    return dtype.itemsize
