"""Client-side counters of this process: reads and bytes per data path, lookups and ids, retries, row cache.

Kept as plain integers under one lock (a few additions per call, never per
row), read with `client.metrics()`; `serve_metrics(port)` also exposes them on
a Prometheus endpoint (`shardserve_client_*`) for an inference process to be
scraped like the servers.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_by_path: dict[str, Counter[str]] = {"reads": Counter(), "read_bytes": Counter()}


def count_read(path: str, nbytes: int) -> None:
    """One fetch answered by `path` (the path of its last part: shm, bulk, grpc, or a mix like shm+bulk)."""
    with _lock:
        _by_path["reads"][path] += 1
        _by_path["read_bytes"][path] += nbytes


def count(name: str, amount: int = 1) -> None:
    """Add `amount` to the counter `name` (one of COUNTERS)."""
    with _lock:
        _counts[name] += amount


def metrics() -> dict[str, Any]:
    """This process's client counters since it started: each of COUNTERS (an int), and "reads" and "read_bytes"
    ({path: int})."""
    with _lock:
        out: dict[str, Any] = {name: _counts[name] for name in COUNTERS}
        out.update({name: dict(counter) for name, counter in _by_path.items()})
    return out


COUNTERS = {
    "lookups": "lookup and lookup_bag calls",
    "lookup_ids": "ids looked up (before removing duplicates)",
    "retries": "reads and lookups asked again after a retryable error (stale version, rank gone)",
    "row_cache_hits": "rows answered by the row cache",
    "row_cache_misses": "rows the row cache did not hold",
    "delta_puts": "delta puts that sent only the blocks that changed",
    "delta_bytes": "bytes of changed blocks sent by delta puts",
    "delta_hashed_bytes": "bytes delta puts read to hash them (a source whose version counter counted no "
    "write is not read where the put trusts version counters)",
    "shm_opens": "shards a shared-memory read opened on their rank (OpenShard); a kept mapping opens none",
    "shm_labelled": "shards of a new version a shared-memory read found by their label in a segment it maps "
    "already (the rank recycled it for that version), opening none",
    "shm_copies": "shards of a new version a shared-memory read found announced as whole copies of versions it "
    "maps already (a delta snapshot's unchanged tensors), opening none",
    "cuda_ipc_opens": "CUDA IPC handles of same-host ranks' CUDA shards opened, to read or write in place; "
    "memory opened before and reused by the rank opens none",
}


class _ClientCollector:
    """Prometheus view of the counters, read at scrape time."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        now = metrics()
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(f"shardserve_client_{name}", text, value=now[name])
        for name, text in (
            ("reads", "fetches, by the data path that answered"),
            ("read_bytes", "bytes fetched, by data path"),
        ):
            family = CounterMetricFamily(f"shardserve_client_{name}", text, labels=["path"])
            for path, value in sorted(now[name].items()):
                family.add_metric([path], value)
            yield family


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve the client counters at http://HOST:PORT/metrics (0: any free port) on a daemon thread; returns the
    port. Needs prometheus-client (a dependency of shardserve)."""
    from prometheus_client import CollectorRegistry, start_http_server

    if not 0 <= port < 65536:
        raise ValueError(f"port {port} is not a TCP port (0-65535)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ClientCollector())
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
