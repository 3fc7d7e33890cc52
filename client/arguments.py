"""Checks of the caller's plain arguments (seconds, counts, flags, names, callbacks), each error naming the argument.

Values reach protobuf fields and gRPC deadlines, which answer out-of-range or
ill-typed values with messages that name no argument ("Value out of range",
"bad argument type for built-in operation") or, for a deadline of 1e12 s, with
an immediate DEADLINE_EXCEEDED; these checks come first.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardserve.client.errors import InvalidArgumentError

MAX_SECONDS = 365 * 86400.0  # longer deadlines overflow gRPC's clock arithmetic (and mean "never")
INT64_LIMIT = 1 << 63


def seconds(value: Any, field: str, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with `allow_zero`) and at most MAX_SECONDS."""
    low = "0 <=" if allow_zero else "0 <"
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (
            (float(value) >= 0 if allow_zero else float(value) > 0) and float(value) <= MAX_SECONDS
        )
    ):  # NaN fails both
        raise InvalidArgumentError(
            f"{field} must be a number of seconds with {low} {field} <= {MAX_SECONDS:g} "
            f"(one year), got {value!r}"
        )
    return float(value)


def count(value: Any, field: str, minimum: int = 0) -> int:
    """An int (numpy ints too, not bools) in [minimum, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{field} must be an int, got {value!r}")
    if not minimum <= int(value) < INT64_LIMIT:
        raise InvalidArgumentError(f"{field} must be in [{minimum}, 2**63), got {int(value)}")
    return int(value)


def flag(value: Any, field: str) -> bool:
    """A bool: a string such as "no" would otherwise count as True."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{field} must be True or False, got {value!r}")
    return value


def flag_or_word(value: Any, field: str, word: str) -> bool | str:
    """True, False or `word`: a mode beyond yes and no (reserve_next="later", delta="version_counters")."""
    if value is True or value is False or (isinstance(value, str) and value == word):
        return value
    raise InvalidArgumentError(
        f"{field} must be True, False or {word!r}, got {value!r}", metadata={"field": field}
    )


def callback(value: Any, field: str) -> Callable[..., Any] | None:
    """None or a callable, checked before any work starts rather than when the first report comes."""
    if value is not None and not callable(value):
        raise TypeError(f"{field} must be callable, got {type(value).__name__}")
    return value


def tensor_name(name: Any, field: str = "name") -> str:
    """A non-empty string that travels as UTF-8."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{field} must be a non-empty string, got {name!r}")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise InvalidArgumentError(
            f"{field} {name!r} is not valid Unicode text (a lone surrogate)"
        ) from None
    return name


def name_list(names: Any, field: str = "names") -> list[str] | None:
    """None, one name, or an iterable of names (read once: a generator is not used up by a first check)."""
    if names is None:
        return None
    if isinstance(names, str):
        return [tensor_name(names, field)]
    if isinstance(names, (bytes, bytearray)) or not isinstance(names, Iterable):
        raise TypeError(
            f"{field} must be a name or an iterable of names, got {type(names).__name__}"
        )
    listed = list(names)
    return [tensor_name(name, f"{field}[{i}]") for i, name in enumerate(listed)]


def dense_tensor(tensor: torch.Tensor, field: str) -> torch.Tensor:
    """`tensor` if it is a dense tensor holding data (not meta, sparse or nested); InvalidArgumentError naming it."""
    if tensor.layout != torch.strided or tensor.is_nested or tensor.device.type == "meta":
        raise InvalidArgumentError(
            f"{field} must be a dense tensor holding data, got layout {tensor.layout} on "
            f"{tensor.device}{' (nested)' if tensor.is_nested else ''}"
        )
    return tensor
