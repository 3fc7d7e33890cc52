"""A table's options as the rank keeps them: what a lookup of an id outside the table answers, and
whether the version is persisted."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OovPolicy(enum.Enum):
    """What a lookup answers for an id outside the table (the client applies it; the rank keeps it)."""

    ERROR = 0
    ZERO = 1
    DEFAULT = 2


@dataclass(frozen=True)
class TensorOptions:
    """A tensor's options: its out-of-table policy, for OovPolicy.DEFAULT the raw bytes of its default row,
    and whether a persisting rank writes the version to disk (`durable`)."""

    oov: OovPolicy = OovPolicy.ERROR
    default_row: bytes = b""
    durable: bool = True
