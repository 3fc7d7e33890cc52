"""What a client asks the coordinator to make: a new version of a tensor, as plain values.

Cluster methods (create, put) and row updates describe the version they want with a `NewTensor`; only the
session (client/session.py) turns it into a CreateTensorRequest, with the put token that makes a lost
answer safe to abort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.core.metadata import ShardedTensorMetadata

INITS = (
    "none",
    "zeros",
    "ones",
    "normal",
    "arange",
    "copy",
)  # how the ranks fill the new version's shards


@dataclass(frozen=True)
class TableOptions:
    """A table's options: what a lookup of an id outside it answers (`oov`: "error", "zero" or "default", with
    the raw bytes of the default row), and whether ranks with a persist dir write the version to disk."""

    oov: str = "error"
    default_row: bytes = b""
    durable: bool = True


@dataclass(frozen=True)
class NewTensor:
    """A version to create: the tensor's name and layout, how its shards are filled (`init`, one of INITS; a
    `seed` for "normal"; "copy" copies the READY version, or `source_version`), whether it may replace an
    existing tensor, and its table options."""

    name: str
    metadata: ShardedTensorMetadata
    init: str = "none"
    seed: int = 0
    overwrite: bool = False
    options: TableOptions = field(default_factory=TableOptions)
    source_version: int = 0

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
