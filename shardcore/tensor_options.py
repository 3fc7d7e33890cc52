"""A tensor's options, one type for client, coordinator and rank: what a lookup of an id outside the table
answers, and whether ranks with a persist dir keep the version on disk.

The wire carries them as a TensorOptions message (an OovPolicy enum, a default row, not_durable); each side
converts at its edge (client/session.py, server/coordinator/catalog/messages.py, server/rank/wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.core.embedding import OOV_POLICIES


@dataclass(frozen=True)
class TensorOptions:
    """`oov` (one of OOV_POLICIES: "error", "zero" or "default") and `default_row` (the raw bytes of the row
    looked up with "default") answer out-of-range ids; `durable` False keeps the version off the ranks'
    disks."""

    oov: str = "error"
    default_row: bytes = b""
    durable: bool = True

    def __post_init__(self) -> None:
        if self.oov not in OOV_POLICIES:
            raise ValueError(f"oov must be one of {OOV_POLICIES}, got {self.oov!r}")
