"""Hedged reads on against off with no failure: the overhead of racing every part (client.paths.hedging).

Reads a 4 KiB box (one part) and looks up 64 ids of a mirrored 2-rank table,
per round once with hedging on (hedge_after=0.1) and once off, over the bulk
port and over gRPC, the clients taking turns; prints p50 and p99 in ms.

    python -m benchmarks.hedging [--rounds 1000] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from benchmarks.latency import p50_p99_ms, write_json

ROWS, COLUMNS = 4096, 256


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hedging", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    from shardserve import connect
    from shardserve.core.metadata import ShardMetadata
    from shardserve.core.specs import EnumerableShardingSpec
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    half = ROWS // 2
    spec = EnumerableShardingSpec(
        [
            ShardMetadata((0, 0), (half, COLUMNS), "rank:0/cpu"),
            ShardMetadata((0, 0), (half, COLUMNS), "rank:1/cpu"),
            ShardMetadata((half, 0), (half, COLUMNS), "rank:1/cpu"),
            ShardMetadata((half, 0), (half, COLUMNS), "rank:0/cpu"),
        ]
    )
    ids = torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(0))
    results = {}
    with (
        tempfile.TemporaryDirectory() as state,
        LocalCluster(
            ranks=2,
            state_dir=state,
            rank_options=RankOptions(log_level="WARNING"),
            start_method="forkserver",
        ) as cluster,
    ):
        with connect(cluster.address) as writer:
            writer.put("hedging", torch.randn(ROWS, COLUMNS), spec=spec)
        for transport in ("bulk", "grpc"):
            clients = {
                mode: connect(cluster.address, transport=transport, hedge_after=after)
                for mode, after in (("on", 0.1), ("off", None))
            }
            tensors = {mode: client.tensor("hedging") for mode, client in clients.items()}
            reads = {
                "fetch 4 KiB": lambda t: t.fetch((10, 0), (4, COLUMNS)),
                "lookup 64 ids": lambda t: t.lookup(ids),
            }
            for what, read in reads.items():
                times: dict[str, list[float]] = {"on": [], "off": []}
                for _ in range(args.rounds):
                    for mode, remote in tensors.items():
                        start = time.perf_counter()
                        read(remote)
                        times[mode].append(1000 * (time.perf_counter() - start))
                for mode, values in times.items():
                    key = f"{transport} {what} hedging {mode}"
                    results[key] = p50_p99_ms(values)
                    print(
                        f"{key:40s} p50 {results[key]['p50_ms']:.3f} ms  p99 {results[key]['p99_ms']:.3f} ms"
                    )
            for client in clients.values():
                client.close()
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
