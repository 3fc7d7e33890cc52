"""Online row updates: the cost of one update by table size, sustained update rate, and reads during updates.

On a 2-rank local cluster (row-wise float32 tables, 256 columns): the time of
one `update_rows` of 64 random rows on tables of 16 MiB, 256 MiB and 1 GiB (the
headline is the ratio 1 GiB / 16 MiB: near 1 when an update costs what it
touches, growing with the table when it copies the table); the sustained rate
of updates with 1 and 4 writer clients on the 16 MiB table; and the p50/p99 of
256-id lookups with no update running and with one writer updating 64 rows
every 50 ms (with --rate-only, only the rates: 1 and 4 writers, twice).

    python -m benchmarks.updates [--quick] [--rate-only] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

import torch

from benchmarks.harness import coordinator_options
from benchmarks.latency import percentile, write_json

COLUMNS = 256
ROWS_PER_UPDATE = 64
LOOKUP_IDS = 256
UPDATE_PERIOD_S = 0.05
QUICK_SECONDS = 1.0  # each rate and latency run of --quick: enough for a smoke test's rows


def rows_of(mib: int) -> int:
    return (mib << 20) // (COLUMNS * 4)


def update_once(client, name: str, rows: int, generator: torch.Generator) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one update_rows of ROWS_PER_UPDATE random rows."""
    ids = torch.randperm(rows, generator=generator)[:ROWS_PER_UPDATE]
    values = torch.randn(ROWS_PER_UPDATE, COLUMNS, generator=generator)
    start = time.perf_counter()
    client.update_rows(name, ids, values)
    return time.perf_counter() - start


def update_cost(address: str, sizes_mib: list[int], repeats: int) -> dict[str, dict]:
    """Median and p90 seconds of one update per table size."""
    from shardserve import connect

    out = {}
    generator = torch.Generator().manual_seed(0)
    with connect(address) as client:
        for mib in sizes_mib:
            name = f"updates_{mib}mib"
            client.put(name, torch.zeros(rows_of(mib), COLUMNS))
            update_once(client, name, rows_of(mib), generator)  # warm: first mappings and buffers
            times = [update_once(client, name, rows_of(mib), generator) for _ in range(repeats)]
            client.delete(name)
            out[f"{mib} MiB"] = {
                "median_s": statistics.median(times),
                "p90_s": percentile(times, 0.9),
            }
            print(
                f"update of {ROWS_PER_UPDATE} rows, {mib:5d} MiB table: median "
                f"{1000 * out[f'{mib} MiB']['median_s']:.1f} ms",
                flush=True,
            )
    return out


def update_rate(address: str, name: str, rows: int, writers: int, seconds: float) -> dict:
    """Updates per second committed by `writers` clients updating one table as fast as they can."""
    from shardserve import connect

    counts, errors = [0] * writers, [0] * writers
    versions: set[int] = (
        set()
    )  # the versions the updates landed in (group commit: fewer than updates)
    stop = time.monotonic() + seconds

    def writer(slot: int) -> None:
        generator = torch.Generator().manual_seed(slot)
        with connect(address) as client:
            while time.monotonic() < stop:
                ids = torch.randperm(rows, generator=generator)[:ROWS_PER_UPDATE]
                values = torch.randn(ROWS_PER_UPDATE, COLUMNS, generator=generator)
                try:
                    versions.add(client.update_rows(name, ids, values))
                    counts[slot] += 1
                except Exception:  # noqa: BLE001 - counted, the rate is the point
                    errors[slot] += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rate = sum(counts) / seconds
    print(
        f"{writers} writer(s): {rate:.1f} updates/s in {len(versions)} versions, {sum(errors)} failed",
        flush=True,
    )
    return {"updates_per_s": rate, "failed": sum(errors), "versions": len(versions)}


def lookups_during(address: str, name: str, rows: int, seconds: float, updating: bool) -> dict:
    """p50/p99 of lookups of LOOKUP_IDS ids (default path), with or without a writer updating every 50 ms."""
    from shardserve import connect

    stop = time.monotonic() + seconds
    failures = [0, 0]

    def writer() -> None:
        generator = torch.Generator().manual_seed(7)
        with connect(address) as client:
            while time.monotonic() < stop:
                try:
                    update_once(client, name, rows, generator)
                except Exception:  # noqa: BLE001 - counted
                    failures[1] += 1
                time.sleep(UPDATE_PERIOD_S)

    thread = threading.Thread(target=writer) if updating else None
    if thread is not None:
        thread.start()
    times = []
    generator = torch.Generator().manual_seed(3)
    with connect(address) as client:
        table = client.tensor(name)
        while time.monotonic() < stop:
            ids = torch.randint(0, rows, (LOOKUP_IDS,), generator=generator)
            start = time.perf_counter()
            try:
                table.lookup(ids)
                times.append(1000 * (time.perf_counter() - start))
            except Exception:  # noqa: BLE001 - counted
                failures[0] += 1
    if thread is not None:
        thread.join()
    label = "with updates" if updating else "no updates"
    result = {
        "p50_ms": statistics.median(times) if times else float("nan"),
        "p99_ms": percentile(times, 0.99),
        "lookups": len(times),
        "failed_lookups": failures[0],
        "failed_updates": failures[1],
    }
    print(
        f"lookups {label}: p50 {result['p50_ms']:.2f} ms p99 {result['p99_ms']:.2f} ms, "
        f"{failures[0]} failed lookups, {failures[1]} failed updates",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.updates", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tables of 4, 16 and 64 MiB, short runs"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="length of each rate and latency run"
    )
    parser.add_argument("--repeats", type=int, default=10, help="updates timed per table size")
    parser.add_argument(
        "--rate-only",
        action="store_true",
        help="only the update rates (1 and 4 writers, twice), no table sizes or lookups",
    )
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.seconds <= 0 or args.repeats < 1:
        parser.error("--seconds must be > 0 and --repeats >= 1")
    sizes = [4, 16, 64] if args.quick else [16, 256, 1024]
    seconds = min(args.seconds, QUICK_SECONDS) if args.quick else args.seconds
    if args.rate_only:
        results = rates_only(seconds)
    else:
        results = _all(sizes, seconds, 3 if args.quick else args.repeats)
    write_json(args.json, results)
    return results


def rates_only(seconds: float) -> dict:
    """The update rates with 1 and 4 writers, each measured twice (the host's load moves single runs)."""
    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

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
        name, rows = "updates_rate", rows_of(16)
        with connect(cluster.address) as client:
            client.put(name, torch.zeros(rows, COLUMNS))
        return {
            "rate": {
                f"{n} writers, run {k}": update_rate(cluster.address, name, rows, n, seconds)
                for k in (1, 2)
                for n in (1, 4)
            }
        }


def _all(sizes: list[int], seconds: float, repeats: int) -> dict:
    """Update cost by table size, update rates, and lookups with and without updates."""
    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    results: dict = {"sizes_mib": sizes}
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
        results["update_cost"] = update_cost(cluster.address, sizes, repeats)
        small = results["update_cost"][f"{sizes[0]} MiB"]["median_s"]
        large = results["update_cost"][f"{sizes[-1]} MiB"]["median_s"]
        results["large_over_small"] = large / small
        print(f"ratio {sizes[-1]} MiB / {sizes[0]} MiB: {large / small:.2f}", flush=True)
        name, rows = "updates_rate", rows_of(16)
        with connect(cluster.address) as client:
            client.put(name, torch.zeros(rows, COLUMNS))
        results["rate"] = {
            f"{n} writers": update_rate(cluster.address, name, rows, n, seconds) for n in (1, 4)
        }
        results["lookups"] = {
            label: lookups_during(cluster.address, name, rows, seconds, updating)
            for label, updating in (("no updates", False), ("with updates", True))
        }
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
