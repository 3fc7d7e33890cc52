"""The coordinator process's one options type: its timings and where it hosts the rendezvous store.

Built from the command line (server/coordinator_process.py) or by a program (LocalCluster, tests), and handed
to the composition root (server/coordinator/server.py) as it is. Importing it costs nothing (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.server.coordinator.ranks.heartbeats import DEFAULT_RATE, HeartbeatPolicy

DEFAULT_REPAIR_AFTER_S = 30.0


@dataclass(frozen=True)
class CoordinatorOptions:
    """The coordinator's timings (seconds) and the rendezvous store it hosts for collective jobs.

    `heartbeat_interval`: the shortest interval ranks are told; `heartbeat_rate`: the heartbeats per second the
    coordinator takes from all ranks together, the interval growing with the cluster to keep within it (0: no
    limit; server/coordinator/ranks/heartbeats.py); `dead_after`: heartbeats missed this long mark a rank dead
    (None: twice the interval the rank was told); `repair_after`:
    how long a rank stays dead before its copies are rebuilt from live replicas; `store_port` 0 = any free
    port of `store_host` (start_coordinator sets the listen host); `lease_duration`: seconds of the leader's
    lease when several coordinators share the catalog (None: a lone coordinator, which leads at once without
    a lease). ValueError names the flag of a value out of range.
    """

    heartbeat_interval: float = 1.0
    heartbeat_rate: float = DEFAULT_RATE
    dead_after: float | None = None
    rpc_timeout: float = 60.0
    pending_timeout: float = 600.0
    repair_after: float = DEFAULT_REPAIR_AFTER_S
    store_port: int = 0
    store_host: str = "0.0.0.0"
    lease_duration: float | None = None

    def __post_init__(self) -> None:
        if not self.heartbeat_interval > 0:
            raise ValueError("--heartbeat-interval must be > 0")
        self.heartbeats  # noqa: B018 - checks the rate too
        if not self.repair_after >= 0:
            raise ValueError("--repair-after must be >= 0 seconds")
        if self.lease_duration is not None and not self.lease_duration > 0:
            raise ValueError("--lease-duration must be > 0 seconds")

    @property
    def heartbeats(self) -> HeartbeatPolicy:
        """The intervals ranks are told and when a silent one is dead."""
        return HeartbeatPolicy(self.heartbeat_interval, self.heartbeat_rate, self.dead_after)
