"""Reshard planning time and row-routing throughput, against baselines run in the same process.

Planning: `plan_reshard` for 10/100/1000 source x 10/100/1000 destination
shards, on row-chunk layouts and on 2-D grids, against (a) the all-pairs
intersection loop (what a naive planner does) and (b) PyTorch DCP's
`create_read_items_for_chunk_list` (one sweep dim) asked for every destination
chunk at once. The baselines only find intersections; plan_reshard also picks
replicas, orders, splits and buckets.

Routing: `RowIndex.route` of 1M int64 ids over a 64-shard table against a
Python loop (bisect per id) on a subset, in ids per second.

    python -m benchmarks.planning [--json FILE] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from bisect import bisect_right
from collections.abc import Callable

import torch

from shardserve.core import (
    ChunkShardingSpec,
    RowIndex,
    Shard,
    ShardedTensorMetadata,
    TensorProperties,
    intersect,
    metadata_from_placements,
    plan_reshard,
    route_rows,
    unique_ids,
)

SHARD_COUNTS = (10, 100, 1000)
GRIDS = {10: (2, 5), 100: (10, 10), 1000: (25, 40)}
DST_GRIDS = {10: (5, 2), 100: (20, 5), 1000: (40, 25)}


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time of `repeats` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def row_layout(count: int, first_rank: int) -> ShardedTensorMetadata:
    return ChunkShardingSpec(
        0, [f"rank:{first_rank + r}/cpu" for r in range(count)]
    ).build_metadata((1_000_003, 64), TensorProperties())


def grid_layout(shape: tuple[int, int], first_rank: int) -> ShardedTensorMetadata:
    ranks = list(range(first_rank, first_rank + shape[0] * shape[1]))
    mesh = [ranks[i * shape[1] : (i + 1) * shape[1]] for i in range(shape[0])]
    return metadata_from_placements((100_003, 8_191), mesh, [Shard(0), Shard(1)])


def all_pairs(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> int:
    """The quadratic baseline: test every (destination, source) pair."""
    found = 0
    for d in dst.shards_metadata:
        for s in src.shards_metadata:
            if intersect(s.box, d.box) is not None:
                found += 1
    return found


def dcp_read_items(src: ShardedTensorMetadata, dst: ShardedTensorMetadata) -> int:
    """PyTorch DCP's load planner for all destination chunks at once."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from shardserve.core.interop import to_dcp_storage_metadata

    storage = to_dcp_storage_metadata(src)
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(s.shard_offsets), sizes=torch.Size(s.shard_sizes))
        for s in dst.shards_metadata
    ]
    return len(create_read_items_for_chunk_list("t", storage, chunks))


def planning_rows(quick: bool) -> list[dict]:
    rows = []
    for layout, (n_src, n_dst) in itertools.product(
        ("rows", "grid"), itertools.product(SHARD_COUNTS, repeat=2)
    ):
        if layout == "rows":
            src, dst = row_layout(n_src, 0), row_layout(n_dst, n_src // 2)
        else:
            src, dst = grid_layout(GRIDS[n_src], 0), grid_layout(DST_GRIDS[n_dst], n_src // 2)
        pairs = n_src * n_dst
        repeats = 5 if pairs <= 10_000 else 2
        plan = plan_reshard(src, dst)
        ours = best_of(lambda: plan_reshard(src, dst), repeats)
        dcp = best_of(lambda: dcp_read_items(src, dst), repeats)
        naive = None if quick and pairs > 10_000 else best_of(lambda: all_pairs(src, dst), 1)
        rows.append(
            {
                "layout": layout,
                "src_shards": n_src,
                "dst_shards": n_dst,
                "transfers": len(plan.transfers),
                "buckets": len(plan.buckets),
                "plan_ms": ours * 1e3,
                "dcp_ms": dcp * 1e3,
                "all_pairs_ms": None if naive is None else naive * 1e3,
                "all_pairs_over_plan": None if naive is None else naive / ours,
                "dcp_over_plan": dcp / ours,
            }
        )
    return rows


def python_loop_route(bounds: list[int], ids: list[int]) -> dict[int, list[int]]:
    """Baseline router: bisect each id in a Python loop."""
    routes: dict[int, list[int]] = {}
    for position, row in enumerate(ids):
        routes.setdefault(bisect_right(bounds, row) - 1, []).append(position)
    return routes


def routing_rows(quick: bool) -> list[dict]:
    n_rows, n_ids, subset = 1_000_000, 1_000_000, 50_000 if quick else 200_000
    ids = torch.randint(0, n_rows, (n_ids,), generator=torch.Generator().manual_seed(0))
    unique, _ = unique_ids(ids)
    layouts = {
        "64 row shards": ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(64)]).build_metadata(
            (n_rows, 128), TensorProperties()
        ),
        "8x8 grid (row x col)": metadata_from_placements(
            (n_rows, 128), [list(range(r * 8, r * 8 + 8)) for r in range(8)], [Shard(0), Shard(1)]
        ),
    }
    rows = []
    for name, meta in layouts.items():
        index = RowIndex(meta)
        bounds = sorted({s.shard_offsets[0] for s in meta.shards_metadata})
        cases = {"1M random ids": ids, f"{len(unique):,} sorted unique ids": unique}
        for kind, batch in cases.items():
            sample = batch[:subset].tolist()
            route_s = best_of(lambda: index.route(batch), 5)
            with_index_s = best_of(lambda: route_rows(meta, batch), 3)
            loop_s = (
                best_of(lambda: python_loop_route(bounds, sample), 1) * len(batch) / len(sample)
            )
            rows.append(
                {
                    "layout": name,
                    "ids": kind,
                    "count": len(batch),
                    "route_ids_per_s": len(batch) / route_s,
                    "route_ms": route_s * 1e3,
                    "route_rows_ids_per_s": len(batch) / with_index_s,
                    "python_loop_ids_per_s": len(batch) / loop_s,
                    "speedup": loop_s / route_s,
                    "routes": len(index.route(batch)),
                }
            )
    unique_s = best_of(lambda: unique_ids(ids), 3)
    rows.append(
        {
            "layout": "unique_ids (torch.unique dedupe)",
            "ids": "1M random ids",
            "count": n_ids,
            "route_ids_per_s": n_ids / unique_s,
            "route_ms": unique_s * 1e3,
            "route_rows_ids_per_s": None,
            "python_loop_ids_per_s": None,
            "speedup": None,
            "routes": None,
        }
    )
    return rows


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if unit == "x":
            return f"{value:,.1f}x"
        if unit == "/s":
            return f"{value / 1e6:,.2f} M/s"
        return f"{value:,.2f}"
    return str(value)


def print_tables(planning: list[dict], routing: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(
        title="plan_reshard planning time (ms, best of runs) vs baselines in the same process"
    )
    for column in (
        "layout",
        "src",
        "dst",
        "transfers",
        "buckets",
        "plan ms",
        "DCP ms",
        "all-pairs ms",
        "all-pairs/plan",
        "DCP/plan",
    ):
        table.add_column(column, justify="right")
    for r in planning:
        table.add_row(
            r["layout"],
            str(r["src_shards"]),
            str(r["dst_shards"]),
            str(r["transfers"]),
            str(r["buckets"]),
            _fmt(r["plan_ms"]),
            _fmt(r["dcp_ms"]),
            _fmt(r["all_pairs_ms"]),
            _fmt(r["all_pairs_over_plan"], "x"),
            _fmt(r["dcp_over_plan"], "x"),
        )
    console.print(table)
    table = Table(title="row routing throughput (ids/s), int64 ids over a 1M-row table")
    for column in (
        "layout",
        "ids",
        "RowIndex.route",
        "ms",
        "route_rows (+index build)",
        "Python loop",
        "route/loop",
        "routes",
    ):
        table.add_column(column, justify="right")
    for r in routing:
        table.add_row(
            r["layout"],
            r["ids"],
            _fmt(r["route_ids_per_s"], "/s"),
            _fmt(r["route_ms"]),
            _fmt(r["route_rows_ids_per_s"], "/s"),
            _fmt(r["python_loop_ids_per_s"], "/s"),
            _fmt(r["speedup"], "x"),
            _fmt(r["routes"]),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="skip the all-pairs baseline above 10,000 pairs and route a smaller loop subset",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for routing (default 1: stable on a shared machine)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    planning = planning_rows(args.quick)
    routing = routing_rows(args.quick)
    print_tables(planning, routing)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "planning": planning,
                    "routing": routing,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
