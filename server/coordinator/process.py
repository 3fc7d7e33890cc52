"""A coordinator process's parts that outlive its terms: `CoordinatorProcess`.

The process has one role (server/coordinator/role.py), one metrics registry and endpoint, and, when several
coordinators share the catalog, one lease keeper (server/coordinator/lease_keeper.py). For every term it leads
it builds a `CoordinatorServer` (server/coordinator/server.py) anew over the catalog opened under that term:
what a term knows of ranks, jobs and epochs starts fresh, as after a restart, and the ranks register with it
again. A lone coordinator (no lease) builds one at once and leads it for good, as it always did.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import cast

from shardserve.server.common.auth import Security
from shardserve.server.common.metrics import MetricsEndpoint, serve_metrics
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.locations import open_catalog
from shardserve.server.coordinator.lease_keeper import LeaseKeeper
from shardserve.server.coordinator.metrics import CoordinatorMetrics, TimedCatalog
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)


class CoordinatorProcess:
    """The role, metrics and lease keeper of one coordinator process over the catalog at `catalog_location`
    (catalog/locations.py: None, the SQLite file under `state_dir`); `metrics`: the process's registry (None:
    no metrics)."""

    def __init__(
        self,
        catalog_location: str | None,
        state_dir: str | Path,
        security: Security,
        options: CoordinatorOptions,
        *,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.catalog_location = catalog_location
        self.state_dir = state_dir
        self.security = security
        self.options = options
        self.metrics = metrics
        self.role = CoordinatorRole("", lease_duration=options.lease_duration or 0.0)
        self.metrics_address = ""
        self._keeper: LeaseKeeper | None = None
        # the catalog the lease is kept over, one for all terms (each term opens its own for its writes)
        self._lease_catalog: Catalog | None = None
        self._endpoint: MetricsEndpoint | None = None

    @property
    def shares_catalog(self) -> bool:
        """Whether this coordinator leads under a lease (several may share the catalog)."""
        return self.options.lease_duration is not None

    def build(self, term: int) -> CoordinatorServer:
        """The started parts of `term` (0: a lone coordinator's), over the catalog opened and fenced with it:
        its writes check that the lease still holds the term."""
        catalog = open_catalog(self.catalog_location, self.state_dir)
        if self.shares_catalog:
            catalog.fence(term)
        if self.metrics is not None:  # a proxy that times every Catalog call
            catalog = cast(Catalog, TimedCatalog(catalog, self.metrics.catalog_latency))
        server = CoordinatorServer(catalog, self.security, self.options)
        try:
            server.start()
        except BaseException:
            server.close()
            raise
        server.metrics_address = self.metrics_address
        if self.metrics is not None:
            server.count_jobs_in(self.metrics)
        return server

    def lead_alone(self) -> CoordinatorServer:
        """Lead for good, without a lease (a lone coordinator): the server, built and started now."""
        server = self.build(0)
        self.role.lead(0, server, serve_until=math.inf)
        return server

    def stand(self, address: str, on_change: Callable[[bool], None] = lambda leads: None) -> None:
        """Serving at `address` (as others should dial it): take the lease when it is free and keep it
        (one try now, then on the keeper's thread); `on_change(leads)` is told each time it begins or ends a
        term (and once now)."""
        self.role.address = address
        assert self.options.lease_duration is not None
        self._lease_catalog = open_catalog(self.catalog_location, self.state_dir)
        leadership = self._lease_catalog.leadership(self.options.lease_duration)
        self._keeper = LeaseKeeper(leadership, self.role, self.build)
        metrics = self.metrics

        def changed(term: int | None) -> None:
            if term is not None and metrics is not None:
                metrics.takeovers.inc()
            on_change(term is not None)

        self._keeper.on_change = changed
        on_change(False)
        self._keeper.start()

    def serve_metrics(self, host: str, port: int) -> None:
        """Serve the metrics on `host` at `port` (0: any free port), of whichever term leads at each scrape."""
        assert self.metrics is not None
        role = self.role
        leading = (
            role.current
        )  # the term held, or None on a standby (nothing of ranks, tensors or jobs)
        self.metrics.watch(
            lambda: s.registry.ranks() if (s := leading()) else [],
            lambda: [s.answers.tensor(r) for r in s.catalog.list(True)] if (s := leading()) else [],
            lambda: s.collectives.tracker.in_flight() if (s := leading()) else [],
            lambda: s.collectives.epochs.current if (s := leading()) else 0,
            role.view,
        )
        self._endpoint = serve_metrics(self.metrics, host, port)
        shown = socket.gethostname() if host in ("0.0.0.0", "[::]") else host
        self.metrics_address = f"{shown}:{self._endpoint.port}"
        held = role.current()
        if held is not None:
            held.metrics_address = self.metrics_address
        log.info("coordinator metrics on http://%s/metrics", self.metrics_address)

    def close(self) -> None:
        """Stop leading (resigning the lease), close the term's parts and the metrics endpoint."""
        if self._keeper is not None:
            self._keeper.stop()
        if self._lease_catalog is not None:
            self._lease_catalog.close()
        if self._keeper is None:
            server = self.role.step_down()
            if server is not None:
                server.close()
        if self._endpoint is not None:
            self._endpoint.close()
