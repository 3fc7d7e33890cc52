"""Bulk port against gRPC per read size: why transport="auto" sends every remote read to the bulk port.

Reads boxes of 4 KiB to 2 MiB inside one shard of a 2-rank cluster, once
over the bulk port and once over gRPC per round, the two taking turns, and
prints the median milliseconds of each and their ratio (gRPC / bulk port).

    python -m benchmarks.bulk_port_sizes [--rounds 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

COLUMNS = 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bulk_port_sizes", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    boxes = [
        (1, 1024),
        (4, COLUMNS),
        (16, COLUMNS),
        (64, COLUMNS),
        (128, COLUMNS),
    ]  # 4 KiB ... 2 MiB
    source = torch.randn(4096, COLUMNS)
    results = []
    with (
        tempfile.TemporaryDirectory() as state,
        LocalCluster(
            ranks=2,
            state_dir=state,
            rank_options=RankOptions(log_level="WARNING"),
            start_method="forkserver",
        ) as cluster,
        connect(cluster.address, transport="bulk") as bulk,
        connect(cluster.address, transport="grpc") as plain,
    ):
        paths = {"bulk": bulk.put("sizes", source), "grpc": plain.tensor("sizes")}
        for rows, cols in boxes:
            spent: dict[str, list[float]] = {path: [] for path in paths}
            for _ in range(args.rounds + 1):  # the first round warms up
                for path, remote in paths.items():
                    start = time.perf_counter()
                    got = remote.fetch((0, 0), (rows, cols))
                    spent[path].append(time.perf_counter() - start)
                    assert remote.last_transport == path and torch.equal(got, source[:rows, :cols])
            medians = {path: statistics.median(times[1:]) for path, times in spent.items()}
            results.append({"bytes": rows * cols * 4, **{f"{p}_s": s for p, s in medians.items()}})
            print(
                f"{rows * cols * 4 / 1024:7.0f} KiB  bulk port {medians['bulk'] * 1e3:7.3f} ms  "
                f"gRPC {medians['grpc'] * 1e3:7.3f} ms  ({medians['grpc'] / medians['bulk']:.2f}x)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
