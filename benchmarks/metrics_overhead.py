"""Metrics on against off: a lookup's p50/p99 and a 64 MiB fetch on two identical clusters, in the same run.

One 2-rank cluster runs with --metrics-port (every process records and serves
/metrics, scraped every second as Prometheus would, more often than its
default), the other without; each round looks up 64 ids and fetches 64 MiB
from both, the clusters taking turns, over gRPC and over the bulk port.

    python -m benchmarks.metrics_overhead [--rounds 300] [--fetch-rounds 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

import torch

from benchmarks.latency import p50_p99_ms, write_json

ROWS, COLUMNS = 65536, 256  # float32: 64 MiB
FETCH_ROWS = ROWS  # the whole table: 64 MiB


def scrape_every(address: str, stop: threading.Event, period_s: float = 1.0) -> threading.Thread:
    """Scrape every metrics endpoint of the cluster at `address` each `period_s` until `stop`."""
    from shardserve import connect
    from shardserve.client.cli.top import take_frame

    def run() -> None:
        with connect(address) as cluster:
            while not stop.wait(period_s):
                take_frame(cluster)

    thread = threading.Thread(target=run, name="scraper", daemon=True)
    thread.start()
    return thread


def measure(read, rounds: int, tensors: dict) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    times: dict[str, list[float]] = {mode: [] for mode in tensors}
    for turn in range(rounds):
        order = list(tensors.items())
        for mode, remote in (
            order if turn % 2 else reversed(order)
        ):  # each cluster goes first every other round
            start = time.perf_counter()
            read(remote)
            times[mode].append(1000 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.metrics_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=300, help="lookups per cluster and path")
    parser.add_argument(
        "--fetch-rounds", type=int, default=10, help="64 MiB fetches per cluster and path"
    )
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1 or args.fetch_rounds < 1:
        parser.error("--rounds and --fetch-rounds must be >= 1")

    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    table = torch.randn(ROWS, COLUMNS)
    ids = torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(0))
    results = {}
    with ExitStack() as stack:
        clusters = {}
        for mode, port in (("on", 0), ("off", None)):
            state = stack.enter_context(tempfile.TemporaryDirectory())
            clusters[mode] = stack.enter_context(
                LocalCluster(
                    ranks=2,
                    state_dir=state,
                    rank_options=RankOptions(log_level="WARNING"),
                    metrics_port=port,
                    start_method="forkserver",
                )
            )
            with connect(clusters[mode].address) as writer:
                writer.put("overhead", table)
        stop = threading.Event()
        stack.callback(stop.set)
        scrape_every(clusters["on"].address, stop)
        for transport in ("grpc", "bulk"):
            clients = {
                mode: stack.enter_context(connect(c.address, transport=transport))
                for mode, c in clusters.items()
            }
            tensors = {mode: client.tensor("overhead") for mode, client in clients.items()}
            cases = {
                "lookup 64 ids": (lambda t: t.lookup(ids), args.rounds),
                "fetch 64 MiB": (
                    lambda t: t.fetch((0, 0), (FETCH_ROWS, COLUMNS)),
                    args.fetch_rounds,
                ),
            }
            for what, (read, rounds) in cases.items():
                measure(read, max(1, rounds // 10), tensors)  # warm up both
                for mode, values in measure(read, rounds, tensors).items():
                    key = f"{transport} {what} metrics {mode}"
                    results[key] = p50_p99_ms(values)
                    print(
                        f"{key:36s} p50 {results[key]['p50_ms']:9.3f} ms  p99 {results[key]['p99_ms']:9.3f} ms",
                        flush=True,
                    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
