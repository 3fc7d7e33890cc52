"""What a coordinator does now, as data: its `Role` and the `RoleView` that `shardserve status` (through the
Leadership service) and the metrics show."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    """What a coordinator does now."""

    LEADER = "leader"  # holds the lease and serves
    STANDBY = "standby"  # answers NOT_LEADER, ready to take over


@dataclass(frozen=True)
class RoleView:
    """A coordinator's role as `shardserve status` and the metrics show it: its own `address`, its `term`
    while it leads (0 otherwise, and for a lone coordinator), the leader it knows (`leader`, "" for none, and
    its `leader_term`), the lease's duration (0: no lease) and the terms it began (`takeovers`)."""

    role: Role
    address: str
    term: int = 0
    leader: str = ""
    leader_term: int = 0
    lease_duration: float = 0.0
    takeovers: int = 0
