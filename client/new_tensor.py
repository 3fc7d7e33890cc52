"""What a client asks the coordinator to make: a new version of a tensor, as plain values.

Cluster methods (create, put) and row updates describe the version they want with a `NewTensor`; only the
session (client/session.py) turns it into a CreateTensorRequest, with the put token that makes a lost
answer safe to abort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions

INITS = (
    "none",
    "zeros",
    "ones",
    "normal",
    "arange",
    "copy",
)  # how the ranks fill the new version's shards


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
    options: TensorOptions = field(default_factory=TensorOptions)
    source_version: int = 0
    # a reservation of this client's next put of the name (client/tensor_reservations.py)
    reserve: bool = False

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
