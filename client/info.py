"""Read-only views of the coordinator's answers: a rank's status and a tensor's catalog entry."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardserve.client.errors import ShardServeError
from shardserve.core.health import LayoutHealth, layout_health
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import metadata_from_proto
from shardserve.protos import shardserve_pb2 as pb


@dataclass(frozen=True)
class RestoreStatus:
    """A rank restoring its persist dir: bytes and tensors read of all; `loaded` once every file is read (it
    registers and is re-promoted next: its tensors serve reads only after that)."""

    done_bytes: int
    total_bytes: int
    done_tensors: int
    total_tensors: int
    loaded: bool

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0

    @classmethod
    def from_proto(cls, msg: pb.RestoreProgress) -> RestoreStatus:
        return cls(msg.done_bytes, msg.total_bytes, msg.done_tensors, msg.total_tensors, msg.loaded)


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
    host_id: str = ""  # boot id and namespaces: same hostname and host_id = same host (data plane)
    shared_memory: bool = False  # the rank hands shards over through shared memory (OpenShard)
    restarts: int = (
        0  # new processes that registered this rank number since the coordinator started
    )
    metrics_address: str = (
        ""  # HOST:PORT of its Prometheus /metrics ("" when started without --metrics-port)
    )
    restore: RestoreStatus | None = (
        None  # while it restores its persist dir (then not alive, or not re-promoted)
    )
    # where memory_limit_bytes came from: --memory-limit, a cgroup's limit file, the host's memory
    memory_limit_source: str = ""

    @classmethod
    def from_proto(cls, msg: pb.RankInfo) -> RankStatus:
        return cls(
            rank=msg.rank,
            address=msg.address,
            device=msg.device or "cpu",
            hostname=msg.hostname,
            alive=msg.alive,
            memory_used_bytes=msg.memory_used_bytes,
            memory_limit_bytes=msg.memory_limit_bytes,
            pid=msg.pid,
            last_heartbeat_unix=msg.last_heartbeat_unix,
            host_id=msg.host_id,
            shared_memory=msg.shared_memory,
            restarts=msg.restarts,
            metrics_address=msg.metrics_address,
            restore=RestoreStatus.from_proto(msg.restore) if msg.HasField("restore") else None,
            memory_limit_source=msg.memory_limit_source,
        )


@dataclass(frozen=True)
class RepairProgress:
    """The coordinator's repair of a tensor in flight: the version it makes, bytes copied, ranks receiving."""

    version: int
    bytes_done: int
    bytes_total: int
    ranks: tuple[int, ...]
    started_unix: float

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 0.0


@dataclass(frozen=True)
class TensorSummary:
    """One catalog entry: a tensor's name, version, layout and state ("READY" or "PENDING")."""

    name: str
    version: int
    metadata: ShardedTensorMetadata
    state: str
    nbytes: int
    created_unix: float
    # shards whose copy cannot be read now (on ranks down, hung or restoring, or lost)
    unavailable: frozenset[int] = field(default=frozenset(), repr=False)
    # shards whose copy is known gone (their rank restarted without them): a subset of `unavailable`
    lost: frozenset[int] = field(default=frozenset(), repr=False)
    repair: RepairProgress | None = field(
        default=None, repr=False
    )  # the coordinator repairing lost copies
    # each shard's xxh3-64 by index (shardserve.core.checksums; UNKNOWN or empty where not known)
    checksums: tuple[int, ...] = field(default=(), repr=False)
    answered_at: float = field(
        default_factory=time.monotonic, repr=False, compare=False
    )  # when the answer came

    @functools.cached_property
    def layout_health(self) -> LayoutHealth:
        """Health, lost boxes and replicas as the coordinator's answer had them (shardcore.health)."""
        return layout_health(self.metadata, self.unavailable, self.lost)

    @property
    def health(self) -> str:
        """ "healthy", "degraded" (a box has fewer live copies than replicas), "unavailable" (a box has no
        copy on a live rank now) or "lost" (a box's every copy is known gone)."""
        return self.layout_health.state

    @property
    def replicas(self) -> int:
        """Copies of each box (the minimum over the layout's boxes; 1 without replicas)."""
        return self.layout_health.replicas

    @property
    def shape(self) -> tuple[int, ...]:
        return self.metadata.size

    @property
    def dtype(self) -> torch.dtype:
        return self.metadata.dtype

    @classmethod
    def from_proto(
        cls, msg: pb.TensorInfo, layouts: Sequence[ShardedTensorMetadata] | None = None
    ) -> TensorSummary:
        """The summary of an answer's TensorInfo; `layouts`, the answer's own decoded layouts when it keeps
        them apart (ListTensorsRequest.layouts_apart: the tensor names its layout by index)."""
        if layouts is not None:
            if msg.layout >= len(layouts):
                raise ShardServeError(
                    f"the coordinator sent layout {msg.layout} for tensor {msg.name!r}, "
                    f"of {len(layouts)} layouts"
                )
            metadata = layouts[msg.layout]
        else:
            metadata = layout_of(msg.metadata, f"tensor {msg.name!r}")
        lost = frozenset(msg.lost_shards) if msg.lost_shards else _NONE
        return cls(
            name=msg.name,
            version=msg.version,
            metadata=metadata,
            state=_STATE_NAMES.get(msg.state, str(msg.state)),  # a newer server's: its number
            nbytes=msg.nbytes or metadata.nbytes,
            created_unix=msg.created_unix,
            unavailable=(frozenset(msg.unavailable_shards) | lost)
            if msg.unavailable_shards
            else lost,
            lost=lost,
            repair=_repair(msg),
            checksums=tuple(msg.shard_checksums),
        )


# made once: a snapshot's answer brings one TensorInfo per tensor (hundreds per get of a state dict)
_STATE_NAMES = {
    number: name.replace("TENSOR_STATE_", "") for name, number in pb.TensorState.items()
}
_NONE: frozenset[int] = frozenset()


def layout_of(msg: pb.ShardedTensorMetadata, what: str) -> ShardedTensorMetadata:
    """The layout an answer sent for `what` ("tensor 'w'", "layout 3"); ShardServeError when it is not one."""
    try:
        return metadata_from_proto(msg)
    except (ValueError, TypeError) as err:
        raise ShardServeError(f"the coordinator sent bad metadata for {what}: {err}") from None


def _repair(msg: pb.TensorInfo) -> RepairProgress | None:
    if not msg.HasField("repair"):
        return None
    r = msg.repair
    return RepairProgress(r.version, r.bytes_done, r.bytes_total, tuple(r.ranks), r.started_unix)


def health_summary(summary: TensorSummary) -> str:
    """A tensor's health for people, e.g. "healthy", "degraded, repairing 40% onto rank 2" or
    "lost (2 boxes, ranks 1)"."""
    health = summary.layout_health
    repair = summary.repair
    if health.state not in ("lost", "unavailable"):
        if repair is None:
            return health.state
        onto = f"rank{'s' if len(repair.ranks) > 1 else ''} {','.join(map(str, repair.ranks))}"
        return f"{health.state}, repairing {repair.fraction:.0%} onto {onto}"
    ranks = sorted({summary.metadata.shards_metadata[i].rank for i in summary.unavailable})
    count = len(health.lost_boxes)
    return (
        f"{health.state} ({count} box{'es' if count > 1 else ''}, rank{'s' if len(ranks) > 1 else ''} "
        f"{','.join(map(str, ranks))})"
    )


def layout_summary(meta: ShardedTensorMetadata) -> str:
    """A short human description of a layout, e.g. "3 shards on ranks 0,1,2, split dim 0"."""
    shards = meta.shards_metadata
    ranks = ",".join(str(r) for r in sorted({s.rank for s in shards if s.placement is not None}))
    split = [d for d in range(meta.ndim) if any(s.shard_sizes[d] != meta.size[d] for s in shards)]
    how = (
        "replicated"
        if not split and len(shards) > 1
        else "whole"
        if not split
        else f"split dim{'s' if len(split) > 1 else ''} {','.join(map(str, split))}"
    )
    noun = "shard" if len(shards) == 1 else "shards"
    return f"{len(shards)} {noun} on rank{'s' if ',' in ranks else ''} {ranks}, {how}"


_ROLE_NAMES = {pb.ROLE_LEADER: "leader", pb.ROLE_STANDBY: "standby"}


@dataclass(frozen=True)
class CoordinatorStatus:
    """What one coordinator says it does (`shardserve status`): `role` "leader", "standby" or "unreachable"
    (then `error` says why), the `term` it leads (0: none, or a lone coordinator without a lease), the
    `leader` it knows, its lease's duration (0: none) and the terms it began (`takeovers`)."""

    address: str
    role: str
    term: int = 0
    leader: str = ""
    lease_duration_s: float = 0.0
    takeovers: int = 0
    error: str = ""

    @classmethod
    def from_proto(cls, address: str, info: pb.RoleInfo) -> CoordinatorStatus:
        """The status of the coordinator at `address` from its GetRole answer."""
        return cls(
            address,
            _ROLE_NAMES.get(info.role, "unknown"),
            info.term,
            info.leader_address,
            info.lease_duration_s,
            info.takeovers,
        )
