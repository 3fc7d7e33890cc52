"""What every coordinator driver works with, built once by the composition root (server/coordinator/server.py).

The tensor lifecycle, the reshard, checkpoint, snapshot and repair drivers and the reconciler all read and
write the catalog, ask the registry which ranks are live, call the ranks, and hold per-name locks; they
share one `DriverContext` of those four parts instead of each taking and storing them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.drivers.locks import NameLocks
from shardserve.server.coordinator.ranks.calls import RankCalls
from shardserve.server.coordinator.ranks.registry import RankRegistry


@dataclass(frozen=True)
class DriverContext:
    """The catalog (records), the rank registry (membership, liveness), the calls to ranks and the name
    locks, shared by the coordinator's drivers."""

    catalog: Catalog
    registry: RankRegistry
    calls: RankCalls
    locks: NameLocks
