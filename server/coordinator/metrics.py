"""The coordinator's Prometheus metrics: ranks alive and dead, tensors by state and health, collective jobs in
flight and finished, the latency of catalog transactions, and its leadership (whether it leads, its term, the
terms it began).

Gauges are read from the coordinator at scrape time; collective jobs are
tracked by `JobTracker` (always: a few dict updates per job) and counted in
Prometheus once metrics are on; catalog calls are timed by `TimedCatalog`,
which wraps the catalog only when metrics are on.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.metrics import LATENCY_BUCKETS, Gauge, GaugeCollector, ServerMetrics
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.role_view import Role, RoleView

JOB_KINDS = frozenset({"reshard", "checkpoint_load", "checkpoint_save"})
EPOCH_HELP = (
    "the current epoch of collective jobs (a new one after a failed job, a rank's registration or a "
    "coordinator start; drawn from the catalog's counter, so it grows by more than one)"
)
JOB_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


@dataclass
class JobInFlight:
    """A collective job the coordinator is driving, and its progress summed over its ranks."""

    kind: str
    ranks: int
    bytes_done: int = 0
    bytes_total: int = 0


class JobTracker:
    """Collective jobs in flight (for the gauges and `shardserve top`), and the finished ones counted in
    `metrics` once set."""

    def __init__(self) -> None:
        self.metrics: CoordinatorMetrics | None = None
        self._ids = itertools.count(1)
        self._jobs: dict[int, tuple[JobInFlight, float]] = {}
        self._lock = threading.Lock()

    def start(self, kind: str, ranks: int) -> int:
        """Track a new job; returns its id for progress() and end()."""
        with self._lock:
            job_id = next(self._ids)
            self._jobs[job_id] = (JobInFlight(kind, ranks), time.perf_counter())
        return job_id

    def progress(self, job_id: int, bytes_done: int, bytes_total: int) -> None:
        """A job's bytes moved so far of its total; the bytes new since its last report are counted in
        shardserve_coordinator_job_bytes_moved_total (rate() of it plots progress even between scrapes)."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        moved = max(0, bytes_done - job[0].bytes_done)
        job[0].bytes_done, job[0].bytes_total = bytes_done, bytes_total
        if moved and self.metrics is not None:
            self.metrics.job_bytes_moved.labels(job[0].kind).inc(moved)

    def end(self, job_id: int, ok: bool) -> None:
        with self._lock:
            job, started = self._jobs.pop(job_id)
        if self.metrics is not None:
            self.metrics.jobs.labels(job.kind, "ok" if ok else "failed").inc()
            self.metrics.job_duration.labels(job.kind).observe(time.perf_counter() - started)

    def in_flight(self) -> list[JobInFlight]:
        with self._lock:
            return [job for job, _ in self._jobs.values()]


class CoordinatorMetrics(ServerMetrics):
    """The metrics of a coordinator."""

    def __init__(self) -> None:
        super().__init__("coordinator")
        self.jobs = Counter(
            "shardserve_coordinator_jobs",
            "collective jobs the coordinator drove to their end, by "
            "kind (reshard, checkpoint_load, checkpoint_save; repairs run as reshards) and outcome "
            "(ok, failed)",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.job_bytes_moved = Counter(
            "shardserve_coordinator_job_bytes_moved",
            "bytes collective jobs moved between ranks, by kind (at 0 from the start for every kind)",
            ["kind"],
            registry=self.registry,
        )
        for kind in sorted(JOB_KINDS):
            self.job_bytes_moved.labels(kind)
        self.job_duration = Histogram(
            "shardserve_coordinator_job_duration_seconds",
            "wall time of a collective job on its ranks, by kind",
            ["kind"],
            buckets=JOB_BUCKETS,
            registry=self.registry,
        )
        self.takeovers = Counter(
            "shardserve_coordinator_takeovers",
            "terms this coordinator began: each time it took the lease (its first term included); 0 "
            "for a lone coordinator without a lease",
            registry=self.registry,
        )
        self.catalog_latency = Histogram(
            "shardserve_coordinator_catalog_seconds",
            "time of one catalog transaction (SQLite), by operation",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch(
        self,
        ranks: Callable[[], list[RankInfo]],
        tensors: Callable[[], list[pb.TensorInfo]],
        jobs: Callable[[], list[JobInFlight]],
        epoch: Callable[[], int],
        role: Callable[[], RoleView],
    ) -> None:
        """Report ranks, tensors (every version, as answered: with its health), jobs in flight, the epoch and
        the coordinator's role at every scrape (a standby: no ranks, tensors or jobs; epoch 0)."""
        self.add_collector(
            GaugeCollector(
                lambda: [
                    *_rank_gauges(ranks()),
                    _tensor_gauge(tensors()),
                    *_job_gauges(jobs()),
                    Gauge(
                        "shardserve_coordinator_epoch",
                        EPOCH_HELP,
                    ).add(epoch()),
                    *_role_gauges(role()),
                ]
            )
        )


def _rank_gauges(ranks: list[RankInfo]) -> list[Gauge]:
    states = Gauge(
        "shardserve_coordinator_ranks", "registered ranks, by state (alive, dead)", ("state",)
    )
    alive = sum(1 for r in ranks if r.alive)
    states.add(alive, "alive").add(len(ranks) - alive, "dead")
    memory = Gauge(
        "shardserve_coordinator_rank_memory_used_bytes",
        "bytes of shards each rank held at its last heartbeat",
        ("rank",),
    )
    restarts = Gauge(
        "shardserve_coordinator_rank_restarts",
        "times each rank was restarted since the coordinator started",
        ("rank",),
    )
    for rank in ranks:
        memory.add(rank.memory_used_bytes, str(rank.rank))
        restarts.add(rank.restarts, str(rank.rank))
    return [states, memory, restarts]


def _role_gauges(view: RoleView) -> list[Gauge]:
    leader = Gauge(
        "shardserve_coordinator_is_leader",
        "1 while this coordinator leads (a lone coordinator always does), 0 while it stands by",
    )
    term = Gauge(
        "shardserve_coordinator_term",
        "the term this coordinator leads (0 while it stands by, and for a lone coordinator)",
    )
    return [leader.add(1 if view.role == Role.LEADER else 0), term.add(view.term)]


def _tensor_gauge(tensors: Iterable[pb.TensorInfo]) -> Gauge:
    counts: dict[tuple[str, str], int] = {}
    for info in tensors:
        key = (pb.TensorState.Name(info.state).lower(), info.health or "healthy")
        counts[key] = counts.get(key, 0) + 1
    gauge = Gauge(
        "shardserve_coordinator_tensors",
        "tensor versions in the catalog, by state (ready, pending) and "
        "health (healthy, degraded, unavailable, lost)",
        ("state", "health"),
    )
    for (state, health), count in sorted(counts.items()):
        gauge.add(count, state, health)
    return gauge


def _job_gauges(jobs: list[JobInFlight]) -> list[Gauge]:
    running = Gauge(
        "shardserve_coordinator_jobs_in_flight", "collective jobs running now, by kind", ("kind",)
    )
    done = Gauge(
        "shardserve_coordinator_job_bytes_done",
        "bytes moved so far by the jobs in flight, by kind",
        ("kind",),
    )
    total = Gauge(
        "shardserve_coordinator_job_bytes_total",
        "bytes the jobs in flight move in all, by kind",
        ("kind",),
    )
    for kind in sorted(
        JOB_KINDS | {job.kind for job in jobs}
    ):  # every kind, 0 when idle: the series exist
        mine = [job for job in jobs if job.kind == kind]
        running.add(len(mine), kind)
        done.add(sum(job.bytes_done for job in mine), kind)
        total.add(sum(job.bytes_total for job in mine), kind)
    return [running, done, total]


class TimedCatalog:
    """A catalog whose every public call is timed into `histogram` by operation name."""

    def __init__(self, catalog: Any, histogram: Histogram) -> None:
        self._catalog = catalog
        self._histogram = histogram

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._catalog, name)
        if name.startswith("_") or not callable(attribute):
            return attribute
        observe = self._histogram.labels(name).observe

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                observe(time.perf_counter() - start)

        return timed
