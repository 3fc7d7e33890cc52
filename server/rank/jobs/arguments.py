"""Checks of plain arguments (counts, seconds) of the rank's job functions, for callers in-process."""

from __future__ import annotations

import math
import operator
from typing import Any


def non_negative_int(value: Any, name: str) -> int:
    """`value` as an int >= 0; TypeError or ValueError naming `name` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def positive_seconds(value: Any, name: str) -> float:
    """`value` as a positive finite float of seconds; TypeError or ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value}")
    return float(value)
