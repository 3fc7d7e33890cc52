"""Read-only views of the coordinator's answers: a rank's status and a tensor's catalog entry."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from client.errors import ShardServeError
from protos import shardserve_pb2 as pb
from shardcore.metadata import ShardedTensorMetadata
from shardcore.wire import metadata_from_proto


@dataclass(frozen=True)
class RankStatus:
    """One registered rank as the coordinator sees it."""

    rank: int
    address: str
    device: str
    hostname: str
    alive: bool
    memory_used_bytes: int
    memory_limit_bytes: int
    pid: int
    last_heartbeat_unix: float
    host_id: str = ""            # the rank's boot id: same hostname and host_id = same host (data plane)
    shared_memory: bool = False  # the rank hands shards over through shared memory (OpenShard)

    @classmethod
    def from_proto(cls, msg: pb.RankInfo) -> "RankStatus":
        return cls(rank=msg.rank, address=msg.address, device=msg.device or "cpu", hostname=msg.hostname,
                   alive=msg.alive, memory_used_bytes=msg.memory_used_bytes,
                   memory_limit_bytes=msg.memory_limit_bytes, pid=msg.pid,
                   last_heartbeat_unix=msg.last_heartbeat_unix, host_id=msg.host_id,
                   shared_memory=msg.shared_memory)


@dataclass(frozen=True)
class TensorSummary:
    """One catalog entry: a tensor's name, version, layout and state ("READY" or "PENDING")."""

    name: str
    version: int
    metadata: ShardedTensorMetadata
    state: str
    nbytes: int
    created_unix: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.metadata.size

    @property
    def dtype(self) -> torch.dtype:
        return self.metadata.dtype

    @classmethod
    def from_proto(cls, msg: pb.TensorInfo) -> "TensorSummary":
        try:
            metadata = metadata_from_proto(msg.metadata)
        except (ValueError, TypeError) as err:
            raise ShardServeError(f"the coordinator sent bad metadata for tensor {msg.name!r}: {err}") from None
        return cls(name=msg.name, version=msg.version, metadata=metadata,
                   state=pb.TensorState.Name(msg.state).replace("TENSOR_STATE_", ""),
                   nbytes=msg.nbytes or metadata.nbytes, created_unix=msg.created_unix)


def layout_summary(meta: ShardedTensorMetadata) -> str:
    """A short human description of a layout, e.g. "3 shards on ranks 0,1,2, split dim 0"."""
    shards = meta.shards_metadata
    ranks = ",".join(str(r) for r in sorted({s.rank for s in shards if s.placement is not None}))
    split = [d for d in range(meta.ndim) if any(s.shard_sizes[d] != meta.size[d] for s in shards)]
    how = ("replicated" if not split and len(shards) > 1 else
           "whole" if not split else f"split dim{'s' if len(split) > 1 else ''} {','.join(map(str, split))}")
    noun = "shard" if len(shards) == 1 else "shards"
    return f"{len(shards)} {noun} on rank{'s' if ',' in ranks else ''} {ranks}, {how}"
