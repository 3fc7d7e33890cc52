"""CPU per lookup call, client and ranks, with 1 and 8 client threads: where a lookup's time goes.

On a 2-rank cluster holding a 1M x 64 float32 table row-wise (`--rows`),
each of 8 clients (own connection, as in the lookups scenario) is warmed up,
then 1 thread and then 8 threads look up `--calls` batches of `--ids`
uniform ids each over `--transport`. Printed per case: wall time per call,
this process's CPU per call (every thread of it: time.process_time) and the
ranks' CPU per call (psutil, in 10 ms ticks: use enough calls). On 2 cores,
client + ranks CPU per call bounds the 8-thread rate.

    python -m benchmarks.lookup_cpu [--transport bulk] [--ids 512] [--calls 400] [--rows N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from benchmarks.harness import coordinator_options

DIM, THREADS = 64, 8


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes `pids` so far."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def measure(
    tables: list[Any], batches: list[torch.Tensor], threads: int, rank_pids: list[int]
) -> dict:
    """Wall, client CPU and rank CPU per call of `threads` threads, each looking up every batch."""

    def work(table: Any) -> None:
        for ids in batches:
            table.lookup(ids)

    workers = [threading.Thread(target=work, args=(table,)) for table in tables[:threads]]
    ranks_before, mine_before, start = (
        cpu_seconds(rank_pids),
        time.process_time(),
        time.perf_counter(),
    )
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall, mine_after, ranks_after = (
        time.perf_counter() - start,
        time.process_time(),
        cpu_seconds(rank_pids),
    )
    calls = threads * len(batches)
    return {
        "threads": threads,
        "wall_s": wall / calls,
        "client_cpu_s": (mine_after - mine_before) / calls,
        "ranks_cpu_s": (ranks_after - ranks_before) / calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lookup_cpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--transport", default="bulk", choices=("auto", "grpc", "shm", "bulk"))
    parser.add_argument("--ids", type=int, default=512, help="ids per lookup (default 512)")
    parser.add_argument("--calls", type=int, default=400, help="lookups per thread (default 400)")
    parser.add_argument("--rows", type=int, default=1 << 20, help="table rows (default 1048576)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if min(args.ids, args.calls, args.rows) < 1:
        parser.error("--ids, --calls and --rows must be >= 1")

    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    generator = torch.Generator().manual_seed(1)
    source = torch.randn(args.rows, DIM, generator=generator)
    batches = [
        torch.randint(0, args.rows, (args.ids,), generator=generator) for _ in range(args.calls)
    ]
    with (
        tempfile.TemporaryDirectory() as state,
        LocalCluster(
            ranks=2,
            state_dir=state,
            rank_options=RankOptions(log_level="WARNING"),
            coordinator_options=coordinator_options(),
            start_method="forkserver",
        ) as cluster,
    ):
        with connect(cluster.address, transport="grpc") as writer:
            writer.put("lookup-cpu", source)
        clients = [connect(cluster.address, transport=args.transport) for _ in range(THREADS)]
        try:
            tables = [client.tensor("lookup-cpu") for client in clients]
            for table in tables:
                assert torch.equal(table.lookup(batches[0]), source[batches[0]])
            results = [
                measure(tables, batches, threads, cluster.rank_pids) for threads in (1, THREADS)
            ]
        finally:
            for client in clients:
                client.close()
    for row in results:
        print(
            f"{args.transport} {args.ids} ids, {row['threads']} thread(s): wall {row['wall_s'] * 1e6:.0f} us/call, "
            f"client CPU {row['client_cpu_s'] * 1e6:.0f} us/call, ranks CPU {row['ranks_cpu_s'] * 1e6:.0f} us/call"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "transport": args.transport,
                    "ids": args.ids,
                    "calls": args.calls,
                    "rows": args.rows,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
