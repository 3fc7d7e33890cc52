"""The composition root of a coordinator's term: `CoordinatorServer` builds its parts and runs their threads.

A lone coordinator builds one and keeps it; of several sharing a catalog, the leader builds one for every term
it leads (server/coordinator/process.py), over the catalog fenced with that term, and closes it when the term
ends.

The parts, each given only what it uses: the catalog (records), the rank registry (membership and liveness)
and the calls to ranks, per-name locks and byte quotas, the collective-job runner (with its rendezvous store),
the tensor lifecycle, the reshard, checkpoint, snapshot and repair drivers, the upkeep (reconciling ranks and
the periodic chores) and the answers the servicer makes from records. The drivers and the reconciler share
one DriverContext (catalog, registry, calls, locks: context.py). Building them starts nothing: threads,
the rendezvous store and the repair loop start in `start()`, and `close()` ends them.
"""

from __future__ import annotations

import logging
import secrets

from shardserve.server.common.auth import Security
from shardserve.server.coordinator.answers import Answers
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.drivers.checkpoint import CheckpointDriver
from shardserve.server.coordinator.drivers.collectives import CollectiveRunner
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.drivers.lifecycle import TensorLifecycle
from shardserve.server.coordinator.drivers.locks import NameLocks
from shardserve.server.coordinator.drivers.quotas import ByteQuotas
from shardserve.server.coordinator.drivers.reconcile import Reconciler
from shardserve.server.coordinator.drivers.repair import RepairDriver
from shardserve.server.coordinator.drivers.reshard import ReshardDriver
from shardserve.server.coordinator.drivers.snapshots import SnapshotDriver
from shardserve.server.coordinator.metrics import CoordinatorMetrics
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.ranks.calls import RankCalls
from shardserve.server.coordinator.ranks.registry import RankRegistry
from shardserve.server.coordinator.upkeep import Upkeep

log = logging.getLogger(__name__)


class CoordinatorServer:
    """The coordinator's parts, built over `catalog`, started by `start()` and ended by `close()`."""

    def __init__(
        self,
        catalog: Catalog,
        security: Security = Security(),
        options: CoordinatorOptions = CoordinatorOptions(),
    ) -> None:
        self.catalog = catalog
        self.options = options
        self.registry = RankRegistry(security, heartbeats=options.heartbeats)
        self.calls = RankCalls(self.registry, options.rpc_timeout)
        self.locks = NameLocks()
        self.quotas = ByteQuotas(catalog)
        self.collectives = CollectiveRunner(
            self.registry,
            lambda: catalog.next_versions(1)[0],
            options.store_port,
            options.store_host,
        )
        context = DriverContext(catalog, self.registry, self.calls, self.locks)
        self.reshards = ReshardDriver(context, collectives=self.collectives)
        self.lifecycle = TensorLifecycle(context, quotas=self.quotas, replaced=self.reshards)
        self.checkpoints = CheckpointDriver(
            context, collectives=self.collectives, versions=self.lifecycle, quotas=self.quotas
        )
        # one per process and term led: the pending snapshots of any other coordinator are out of reach here
        self.coordinator_id = secrets.token_hex(8)
        self.snapshots = SnapshotDriver(
            context,
            versions=self.lifecycle,
            pending_timeout=options.pending_timeout,
            coordinator_id=self.coordinator_id,
        )
        self.repairs = RepairDriver(
            catalog,
            registry=self.registry,
            reshards=self.reshards,
            repair_after=options.repair_after,
        )
        self.upkeep = Upkeep(
            catalog,
            registry=self.registry,
            lifecycle=self.lifecycle,
            reconciler=Reconciler(context),
            reshards=self.reshards,
            heartbeat_interval=options.heartbeat_interval,
            pending_timeout=options.pending_timeout,
            coordinator_id=self.coordinator_id,
        )
        self.answers = Answers(self.registry.rank_unreadable, self.repairs.state)
        self.metrics_address = ""  # HOST:PORT of the metrics endpoint as ListRanks tells clients

    def start(self) -> CoordinatorServer:
        """Open the rendezvous store; start watching ranks, the chores and the repair loop."""
        self.collectives.start()
        self.upkeep.start()
        self.repairs.start()
        return self

    def count_jobs_in(self, metrics: CoordinatorMetrics) -> None:
        """Count the collective jobs of this term in `metrics` (the process's, which outlive a term)."""
        self.collectives.tracker.metrics = metrics

    def stop(self) -> None:
        """Stop watching heartbeats, the chores and repairing (the cluster is shutting down on purpose)."""
        self.upkeep.stop()
        self.repairs.stop()

    def close(self) -> None:
        """Stop, then end the calls to ranks and the rendezvous store; close the catalog."""
        self.stop()
        self.upkeep.close()
        self.snapshots.later.close()  # before the drops: a reservation that could not be made submits some
        self.snapshots.drops.close()
        self.registry.close()
        self.calls.close()
        self.collectives.close()
        self.answers.close()
        self.catalog.close()
