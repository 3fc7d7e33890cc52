"""The coordinator's composition root: `CoordinatorServer` builds its parts and runs their threads.

The parts, each given only what it uses: the catalog (records), the rank registry (membership and liveness)
and the calls to ranks, per-name locks and byte quotas, the collective-job runner (with its rendezvous store),
the tensor lifecycle, the reshard, checkpoint, snapshot and repair drivers, the upkeep (reconciling ranks and
the periodic chores) and the answers the servicer makes from records. The drivers and the reconciler share
one DriverContext (catalog, registry, calls, locks: context.py). Building them starts nothing: threads,
the rendezvous store and the repair loop start in `start()`, and `close()` ends them.
"""

from __future__ import annotations

import logging
import socket

from shardserve.server.common.auth import Security
from shardserve.server.common.metrics import MetricsEndpoint, serve_metrics
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
            self.registry, catalog.next_version, options.store_port, options.store_host
        )
        context = DriverContext(catalog, self.registry, self.calls, self.locks)
        self.reshards = ReshardDriver(context, collectives=self.collectives)
        self.lifecycle = TensorLifecycle(context, quotas=self.quotas, replaced=self.reshards)
        self.checkpoints = CheckpointDriver(
            context, collectives=self.collectives, versions=self.lifecycle, quotas=self.quotas
        )
        self.snapshots = SnapshotDriver(
            context, versions=self.lifecycle, pending_timeout=options.pending_timeout
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
        )
        self.answers = Answers(self.registry.rank_unreadable, self.repairs.state)
        self.metrics_address = ""  # HOST:PORT of the metrics endpoint as ListRanks tells clients
        self._metrics_endpoint: MetricsEndpoint | None = None

    def start(self) -> CoordinatorServer:
        """Open the rendezvous store; start watching ranks, the chores and the repair loop."""
        self.collectives.start()
        self.upkeep.start()
        self.repairs.start()
        return self

    def serve_metrics(self, metrics: CoordinatorMetrics, host: str, port: int) -> None:
        """Serve `metrics`, watching this coordinator, on `host` at `port` (0: any free port)."""
        tracker = self.collectives.tracker
        tracker.metrics = metrics
        metrics.watch(
            self.registry.ranks,
            lambda: [self.answers.tensor(r) for r in self.catalog.list(include_pending=True)],
            tracker,
            lambda: self.collectives.epochs.current,
        )
        self._metrics_endpoint = serve_metrics(metrics, host, port)
        shown = socket.gethostname() if host in ("0.0.0.0", "[::]") else host
        self.metrics_address = f"{shown}:{self._metrics_endpoint.port}"
        log.info("coordinator metrics on http://%s/metrics", self.metrics_address)

    def stop(self) -> None:
        """Stop watching heartbeats, the chores and repairing (the cluster is shutting down on purpose)."""
        self.upkeep.stop()
        self.repairs.stop()

    def close(self) -> None:
        """Stop, then end the calls to ranks and the rendezvous store; close the catalog."""
        self.stop()
        self.upkeep.close()
        self.snapshots.drops.close()
        self.registry.close()
        self.collectives.close()
        self.catalog.close()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
