"""What the coordinator knows of a rank: what it told when it registered, its liveness, and its restore.

The registry (server/coordinator/ranks/registry.py) keeps these, apart from the wire types; ranks/messages.py makes
them from and into protobuf messages at the service edge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestoreProgress:
    """A rank's restore of its persist dir, as it reports it while it runs (before it registers)."""

    rank: int
    pid: int = 0
    done_bytes: int = 0
    total_bytes: int = 0
    done_tensors: int = 0
    total_tensors: int = 0
    loaded: bool = False  # every file is read; the rank registers next and is re-promoted
    hostname: str = ""


@dataclass(frozen=True)
class RankInfo:
    """A rank as it registered (address, device, host, memory, world), with what the coordinator adds: its
    liveness, its last heartbeat, its restarts and its restore while one runs."""

    rank: int
    address: str = ""  # host:port of its ShardServer
    device: str = ""  # "cpu" or "cuda:K"
    hostname: str = ""
    world_size: int = 0
    pid: int = 0
    memory_limit_bytes: int = 0
    memory_limit_source: str = ""
    memory_used_bytes: int = 0
    host_id: str = ""  # same-host clients may map its shards when shared_memory is set
    shared_memory: bool = False
    metrics_address: str = ""
    alive: bool = False
    last_heartbeat_unix: float = 0.0
    restarts: int = (
        0  # new processes registered under this rank number since the coordinator started
    )
    restore: RestoreProgress | None = None  # set while the rank restores its persist dir
