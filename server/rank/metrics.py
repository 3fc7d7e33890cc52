"""A rank's Prometheus metrics: bytes served per data path and tensor, lookups, collective jobs, memory, versions.

Counters are bumped once per call (a read's whole box, a lookup's whole
request), never per chunk or per row. Gauges of the store's state (memory,
versions held and pinned, jobs queued) are read from the store at scrape time.
Nothing is recorded until `enable()` (a rank started with --metrics-port).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from shardserve.server.common.metrics import Gauge, GaugeCollector, ServerMetrics

JOB_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
GRPC, BULK, SHM = "grpc", "bulk", "shm"  # the data paths a rank serves reads over


class StoreState(Protocol):
    """What the gauges read from a rank's store (server/rank/store.py ShardStore.metrics_snapshot)."""

    def metrics_snapshot(self) -> dict[str, Any]: ...


class RankMetrics(ServerMetrics):
    """The metrics of one rank process."""

    def __init__(self, rank: int) -> None:
        super().__init__("rank")
        self.rank = rank
        self.enabled = False
        self.jobs_running = 0
        self._jobs_lock = threading.Lock()
        self._served: dict[tuple[str, str], Any] = {}  # (path, tensor) -> its counter child
        self._looked_up: dict[
            str, tuple[Any, Any]
        ] = {}  # tensor -> its (lookups, ids) counter children
        registry = self.registry
        self.bytes_served = Counter(
            "shardserve_rank_bytes_served",
            "tensor bytes served to readers, by data path (grpc, bulk, shm) and tensor",
            ["path", "tensor"],
            registry=registry,
        )
        self.bytes_written = Counter(
            "shardserve_rank_bytes_written",
            "tensor bytes written by puts (WriteShard) and row updates (WriteRows), by tensor",
            ["tensor"],
            registry=registry,
        )
        self.corrupt_files = Counter(
            "shardserve_rank_corrupt_files",
            "tensors a restore left out because a persisted shard file failed its checksum (or format) "
            "check; their copies are reported lost and repaired from a replica",
            registry=registry,
        )
        self.lookups = Counter(
            "shardserve_rank_lookups",
            "lookup items answered (one per table shard of a Lookup/LookupSmall call), by tensor",
            ["tensor"],
            registry=registry,
        )
        self.lookup_ids = Counter(
            "shardserve_rank_lookup_ids", "ids looked up, by tensor", ["tensor"], registry=registry
        )
        self.jobs = Counter(
            "shardserve_rank_jobs",
            "collective jobs finished, by kind (reshard, checkpoint_load, "
            "checkpoint_save) and outcome (ok, failed)",
            ["kind", "outcome"],
            registry=registry,
        )
        self.job_duration = Histogram(
            "shardserve_rank_job_duration_seconds",
            "time from a collective job's arrival to its end (queueing included), by kind",
            ["kind"],
            buckets=JOB_BUCKETS,
            registry=registry,
        )

    def enable(self) -> RankMetrics:
        self.enabled = True
        return self

    def watch(self, store: StoreState) -> None:
        """Report the store's memory and versions, and the jobs in flight, at every scrape."""
        self.add_collector(GaugeCollector(lambda: self._gauges(store.metrics_snapshot())))

    def served(self, path: str, tensor: str, nbytes: int) -> None:
        if self.enabled:
            child = self._served.get((path, tensor))
            if child is None:
                child = self._served[(path, tensor)] = self.bytes_served.labels(
                    path, self.tensor_label(tensor)
                )
            child.inc(nbytes)

    def corrupt_file(self) -> None:
        """A restore left a tensor out for a corrupt file: counted even before enable(), since restores run
        before the metrics endpoint opens."""
        self.corrupt_files.inc()

    def written(self, tensor: str, nbytes: int) -> None:
        if self.enabled:
            self.bytes_written.labels(self.tensor_label(tensor)).inc(nbytes)

    def looked_up(self, tensor: str, ids: int) -> None:
        if self.enabled:
            children = self._looked_up.get(tensor)
            if children is None:
                label = self.tensor_label(tensor)
                children = self._looked_up[tensor] = (
                    self.lookups.labels(label),
                    self.lookup_ids.labels(label),
                )
            children[0].inc()
            children[1].inc(ids)

    def job_started(self) -> float:
        """Count a job in flight; returns its start time for job_ended."""
        with self._jobs_lock:
            self.jobs_running += 1
        return time.perf_counter()

    def job_ended(self, kind: str, ok: bool, started: float) -> None:
        with self._jobs_lock:
            self.jobs_running -= 1
        if self.enabled:
            self.jobs.labels(kind, "ok" if ok else "failed").inc()
            self.job_duration.labels(kind).observe(time.perf_counter() - started)

    def _gauges(self, snapshot: dict[str, Any]) -> list[Gauge]:
        rank = str(self.rank)
        versions = Gauge(
            "shardserve_rank_versions",
            "tensor versions held, by state (pending, served, "
            "graced: replaced but readable for --version-grace)",
            ("rank", "state"),
        )
        for state, count in sorted(snapshot["versions"].items()):
            versions.add(count, rank, state)
        return [
            Gauge(
                "shardserve_rank_memory_used_bytes",
                "bytes of shards held (pending and served versions)",
                ("rank",),
            ).add(snapshot["memory_used"], rank),
            Gauge(
                "shardserve_rank_memory_limit_bytes", "--memory-limit (0 = unlimited)", ("rank",)
            ).add(snapshot["memory_limit"], rank),
            Gauge(
                "shardserve_rank_memory_reserved_bytes",
                "bytes held by pending versions (puts, reshards and updates not yet committed)",
                ("rank",),
            ).add(snapshot["memory_reserved"], rank),
            Gauge(
                "shardserve_rank_memory_recycled_bytes",
                "bytes of freed versions' memory kept for reuse (--recycle-bytes)",
                ("rank",),
            ).add(snapshot["memory_recycled"], rank),
            versions,
            Gauge(
                "shardserve_rank_versions_pinned",
                "versions with reads in flight (leases) that keep them from being freed",
                ("rank",),
            ).add(snapshot["pinned"], rank),
            Gauge(
                "shardserve_rank_jobs_in_flight",
                "collective jobs queued or running on this rank",
                ("rank",),
            ).add(self.jobs_running, rank),
        ]
