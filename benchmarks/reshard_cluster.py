"""End-to-end reshard through a running cluster (Coordinator.Reshard) against the bare transfer.

For each world size: a LocalCluster of that many ranks, a square float32
tensor created row-wise (Shard(0)), then `RemoteShardedTensor.reshard` to
column-wise (Shard(1)) and back, timed from the client (validation, memory
reservation, the collective job, catalog commit, promotion and drop
included), once with the ranks' default --recycle-bytes (each reshard writes
into the buffers of the version dropped before it) and once with recycling
off (fresh memory each time). In the same run, `benchmarks.reshard.run_world`
measures the bare gloo transfer of the same bytes and `run_reshard` alone in a
plain world. `cluster_reshard_rows` is the same cluster reshard as a row of the suite's "reshard" scenario,
against the same move done in one process: the tensor's rows copied into its column shards (every byte of
the new shards written once, as the ranks write them), into touched memory.

    python -m benchmarks.reshard_cluster [--size-mib 64] [--ranks 2] [--bucket-mib 16] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks import reshard as raw
from benchmarks.baselines import median_seconds
from benchmarks.harness import Row, Target, coordinator_options

GROUP = "reshard"
COPY = "in-process column copies"
TARGET = Target(min_ratio=0.5)  # within 2x of the in-process copy
BUCKET_BYTES = 16 << 20


def cluster_times(
    world: int, n: int, bucket_bytes: int, repeats: int, recycle_bytes: int | None = None
) -> dict:
    """Median seconds of client-side reshards Shard(0) <-> Shard(1) on a local cluster, and the memory report;
    `recycle_bytes` as the ranks' --recycle-bytes (None: their default, 0: recycling off)."""
    from shardserve import connect
    from shardserve.core.specs import ChunkShardingSpec
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    placements = [f"rank:{r}/cpu" for r in range(world)]
    specs = [ChunkShardingSpec(1, placements), ChunkShardingSpec(0, placements)]
    with (
        LocalCluster(
            world,
            state_dir=tempfile.mkdtemp(prefix="bench-reshard-"),
            rank_options=RankOptions(recycle_bytes=recycle_bytes),
            # it times reshards, not liveness: ranks starting while the last cluster's processes end, on a
            # loaded machine, are not taken for dead for two late heartbeats (the default 2 s)
            coordinator_options=coordinator_options(),
            start_method="forkserver",
        ) as cluster,
        connect(cluster.address, timeout=600) as client,
    ):
        tensor = client.create(
            "bench", (n, n), spec=ChunkShardingSpec(0, placements), init="arange"
        )
        reports: list = []
        times = []
        for i in range(repeats + 1):  # the first one warms up
            start = time.perf_counter()
            tensor = tensor.reshard(
                specs[i % 2], bucket_bytes=bucket_bytes, timeout=600, progress=reports.append
            )
            if i:
                times.append(time.perf_counter() - start)
        done = reports[-1]
        expected = (
            torch.arange(n * n).reshape(n, n).to(torch.float32)
        )  # init="arange", as the ranks make it
        return {
            "seconds": statistics.median(times),
            "max_new_shard_bytes": done.max_new_shard_bytes,
            "max_staging_bytes": done.max_staging_bytes,
            "mapped_bytes": done.mapped_bytes,
            "sent_bytes": done.sent_bytes,
            "ok": bool(torch.equal(tensor.fetch((0, 0), (n, n)), expected)),
        }


def cluster_reshard_rows(
    *, size_mib: float, repeats: int, bucket_bytes: int = BUCKET_BYTES
) -> list[Row]:
    """Rows -> columns of a `size_mib` MiB float32 tensor on a 2-rank LocalCluster (half of the bytes cross
    ranks), against the in-process column copies of the whole tensor; the row's note holds the load average."""
    n = raw.square_side(size_mib)
    full = torch.ones(n, n, dtype=torch.float32)
    columns = [torch.zeros(n, n // 2) for _ in range(2)]  # touched: the copies pay no page faults

    def copy_columns() -> None:
        for k, shard in enumerate(columns):
            shard.copy_(full[:, k * (n // 2) : (k + 1) * (n // 2)])

    copy_s = median_seconds(copy_columns, repeats)
    result = cluster_times(2, n, bucket_bytes, repeats)
    case = f"2-rank cluster, {n * n * 4 >> 20} MiB rows<->cols"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        Row(
            GROUP,
            case,
            "shardserve cluster reshard",
            result["seconds"],
            path="gloo" if result["sent_bytes"] else "same-host memory",
            nbytes=full.numel() * 4,
            baseline=COPY,
            ok=result["ok"],
            target=TARGET,
            note=f"load average {load}; each run alternates rows->cols and cols->rows",
            extra={
                k: result[k]
                for k in ("max_new_shard_bytes", "max_staging_bytes", "mapped_bytes", "sent_bytes")
            },
        ),
        Row(GROUP, case, COPY, copy_s, path="in-process", role="baseline", nbytes=full.numel() * 4),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=64.0)
    parser.add_argument("--ranks", default="2", help="comma-separated world sizes")
    parser.add_argument("--bucket-mib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    ns = parser.parse_args(argv)
    bucket = int(ns.bucket_mib * (1 << 20))
    args = {
        "size_mib": ns.size_mib,
        "bucket_bytes": bucket,
        "repeats": ns.repeats,
        "timeout": 1800.0,
        "methods": ["bare", "dtensor", "shardserve"],
    }
    rows = []
    for world in (int(w) for w in ns.ranks.split(",")):
        n = raw.square_side(ns.size_mib)
        plain = raw.run_world(world, args)
        seconds = {r["method"]: r["seconds"] for r in plain["rows"]}
        e2e = cluster_times(world, n, bucket, ns.repeats)
        fresh = cluster_times(world, n, bucket, ns.repeats, recycle_bytes=0)
        rows.append(
            {
                "world": world,
                "n": n,
                "bare_s": seconds[raw.BARE],
                "run_reshard_s": seconds[raw.OURS],
                "dtensor_s": seconds.get(raw.DTENSOR),
                "cluster_reshard_s": e2e["seconds"],
                "cluster_reshard_no_recycling_s": fresh["seconds"],
                "max_new_shard_bytes": e2e["max_new_shard_bytes"],
                "max_staging_bytes": e2e["max_staging_bytes"],
            }
        )
    from rich.console import Console
    from rich.table import Table

    out = Table(
        title=f"Reshard Shard(0) <-> Shard(1) float32 through the cluster, gloo on 127.0.0.1, "
        f"{os.cpu_count()} cores, buckets {ns.bucket_mib:g} MiB"
    )
    for column in (
        "ranks",
        "tensor",
        "bare s",
        "run_reshard s",
        "DTensor s",
        "cluster reshard s",
        "x bare",
        "x run_reshard",
        "recycling off s",
        "x bare (off)",
        "new shard MiB/rank",
        "staging MiB/rank",
    ):
        out.add_column(column, justify="right")
    for r in rows:
        mib = r["n"] * r["n"] * 4 / (1 << 20)
        out.add_row(
            str(r["world"]),
            f"{r['n']}x{r['n']} ({mib:.0f} MiB)",
            f"{r['bare_s']:.3f}",
            f"{r['run_reshard_s']:.3f}",
            "-" if r["dtensor_s"] is None else f"{r['dtensor_s']:.3f}",
            f"{r['cluster_reshard_s']:.3f}",
            f"{r['cluster_reshard_s'] / r['bare_s']:.2f}",
            f"{r['cluster_reshard_s'] / r['run_reshard_s']:.2f}",
            f"{r['cluster_reshard_no_recycling_s']:.3f}",
            f"{r['cluster_reshard_no_recycling_s'] / r['bare_s']:.2f}",
            f"{r['max_new_shard_bytes'] / (1 << 20):.1f}",
            f"{r['max_staging_bytes'] / (1 << 20):.1f}",
        )
    Console(width=180).print(out)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
