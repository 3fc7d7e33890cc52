"""Fetch throughput of a 64 MiB box over gRPC from a local 2-rank cluster.

Prints a table and one JSON line: GB/s of RemoteShardedTensor.fetch for a box
inside one shard and a box split across both ranks, as a ratio to an
in-process memcpy of the same bytes (the baseline, measured in this process).

    .venv/bin/python -m benchmarks.fetch [--ranks 2] [--mib 64] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Callable

import torch

from client import connect
from server.launcher import LocalCluster

COLUMNS = 4096  # float32 columns: one row is 16 KiB


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    """Median wall time of `run` over `repeat` calls, after one warm-up call."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="shard servers (default 2)")
    parser.add_argument("--mib", type=int, default=64, help="box size in MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=5, help="timed fetches per case (default 5)")
    args = parser.parse_args()
    box_rows = (args.mib << 20) // (COLUMNS * 4)
    rows = box_rows * args.ranks  # each rank holds one box worth of rows
    source = torch.randn(rows, COLUMNS)
    nbytes = box_rows * COLUMNS * 4
    with tempfile.TemporaryDirectory() as state:
        cluster = LocalCluster(ranks=args.ranks, state_dir=state)
        cluster.start(timeout=120)
        try:
            with connect(cluster.address, timeout=120) as cl:
                remote = cl.put("bench", source)
                out = torch.empty(box_rows, COLUMNS)
                half = box_rows // 2
                cases = {
                    "memcpy (baseline)": lambda: out.copy_(source[:box_rows]),
                    "fetch, one shard": lambda: remote.fetch((0, 0), (box_rows, COLUMNS), out=out),
                    "fetch, two shards": lambda: remote.fetch((half, 0), (box_rows, COLUMNS), out=out),
                }
                seconds = {name: median_seconds(run, args.repeat) for name, run in cases.items()}
                assert torch.equal(remote.fetch((half, 0), (box_rows, COLUMNS)), source[half:half + box_rows])
        finally:
            cluster.stop()
    baseline = nbytes / seconds["memcpy (baseline)"]
    print(f"{'case':<20} {'MiB':>6} {'seconds':>9} {'GB/s':>8} {'vs memcpy':>10}")
    results = {}
    for name, s in seconds.items():
        rate = nbytes / s
        results[name] = {"mib": args.mib, "seconds": s, "gb_per_s": rate / 1e9, "ratio": rate / baseline}
        print(f"{name:<20} {args.mib:>6} {s:>9.4f} {rate / 1e9:>8.3f} {rate / baseline:>10.4f}")
    print(json.dumps({"benchmark": "fetch", "ranks": args.ranks, "repeat": args.repeat, "results": results}))


if __name__ == "__main__":
    main()
