"""Scenarios "lookups" and "checkpoint": embedding lookups and DCP checkpoint load/save.

lookups: a 1,000,000 x 64 float32 table row-wise over a 2-rank LocalCluster;
lookups of 1, 512 and 4096 ids (uniform, and Zipf with exponent 1.05 over the
rows): p50 and p99 latency of one client, and rows/s with 8 concurrent client
threads. Baselines in the same run: torch.distributed.rpc serving the same
table from two server processes holding one half each (the way torch's
ShardedTensor reached remote shards: route ids by owner, `rpc_async` the
owners, stitch), measured by a client process of its own so it has its own rpc
agent, once per TensorPipe transport (shm, which busy-polls a core in each
process, and uv; the faster is the row); and a local `index_select` (the
limit).

checkpoint: the same table as a DCP checkpoint on local disk;
`Cluster.load_checkpoint` (each rank reads its half) against
`torch.distributed.checkpoint.load` into a local tensor in this process (and,
to tell the reader's share from the ranks' parallelism, `dcp.load` in this
process through server/rank/jobs/checkpoint_reader.py's RegionReader), and
`Cluster.save_checkpoint` against `dcp.save` of a local tensor.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from benchmarks.baselines import (
    RPC_TRANSPORTS,
    fastest_transport,
    loopback_env,
    rpc_backend_options,
)
from benchmarks.harness import Context, Row, scenario
from shardserve.server.rank_start import forkserver_context

ROWS, DIM, RANKS = 1_000_000, 64, 2
QUICK_ROWS = 100_000
BATCHES = (1, 512, 4096)
ZIPF_S = 1.05
CLIENT_THREADS = 8
SHARDSERVE, RPC, LOCAL = "shardserve lookup", "torch.distributed.rpc", "local index_select"


def table(rows: int) -> torch.Tensor:
    """The benchmark table: the same numbers in every process (cheap to make)."""
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(0))


def id_batches(rows: int, size: int, dist: str, count: int, seed: int = 1) -> list[torch.Tensor]:
    """`count` batches of `size` ids, uniform or Zipf(1.05) over the rows (hot rows scattered by a permutation)."""
    generator = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        return [torch.randint(0, rows, (size,), generator=generator) for _ in range(count)]
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-ZIPF_S)
    permutation = torch.randperm(rows, generator=generator)
    ranks = torch.multinomial(weights, size * count, replacement=True, generator=generator)
    return list(permutation[ranks].view(count, size))


def repeats(size: int, quick: bool) -> int:
    return (20 if quick else 200) if size <= 512 else (10 if quick else 60)


def latencies(run: Callable[[torch.Tensor], object], batches: list[torch.Tensor]) -> list[float]:
    """Seconds of each call, after two warm-up calls."""
    for ids in batches[:2]:
        run(ids)
    out = []
    for ids in batches:
        start = time.perf_counter()
        run(ids)
        out.append(time.perf_counter() - start)
    return out


def throughput(
    make_runner: Callable[[], Callable[[torch.Tensor], object]],
    batches: list[torch.Tensor],
    threads: int,
) -> float:
    """Seconds per call with `threads` concurrent callers, each going through `batches` once after one
    untimed warm-up call (a caller's first call sets up connections and mappings: steady state is measured)."""
    runners = [make_runner() for _ in range(threads)]
    for runner in runners:
        runner(batches[0])
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(runner: Callable[[torch.Tensor], object]) -> None:
        barrier.wait()
        try:
            for ids in batches:
                runner(ids)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors.append(err)

    workers = [threading.Thread(target=work, args=(r,)) for r in runners]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed / (threads * len(batches))


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------- torch.distributed.rpc baseline

RPC_WORKERS = 16


_HALF: torch.Tensor | None = None


def _rows_of_half(local_ids: torch.Tensor) -> torch.Tensor:
    """Runs on an rpc server: rows of its half of the table."""
    assert _HALF is not None
    return _HALF.index_select(0, local_ids)


def _rpc_server(rank: int, rows: int, port: int, transport: str) -> None:
    global _HALF
    from torch.distributed import rpc

    loopback_env()
    half = rows // RANKS
    _HALF = table(rows)[(rank - 1) * half : rank * half].clone()
    rpc.init_rpc(
        f"server{rank}",
        rank=rank,
        world_size=RANKS + 1,
        rpc_backend_options=rpc_backend_options(port, transport, RPC_WORKERS),
    )
    rpc.shutdown(graceful=True, timeout=600)


def _rpc_lookup(ids: torch.Tensor, half: int) -> torch.Tensor:
    """The client side: unique ids, route by owner, rpc_async both halves, stitch in the caller's order."""
    from torch.distributed import rpc

    unique, inverse = torch.unique(ids, return_inverse=True)
    owner = unique // half
    out = torch.empty(unique.numel(), DIM)
    futures = []
    for r in range(RANKS):
        mask = owner == r
        if bool(mask.any()):
            futures.append(
                (
                    mask,
                    rpc.rpc_async(f"server{r + 1}", _rows_of_half, args=(unique[mask] - r * half,)),
                )
            )
    for mask, future in futures:
        out[mask] = future.wait()
    return out[inverse]


def _rpc_client(
    rows: int, port: int, transport: str, cases: list[tuple[int, str, int]], conn
) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed import rpc

    loopback_env()
    rpc.init_rpc(
        "client",
        rank=0,
        world_size=RANKS + 1,
        rpc_backend_options=rpc_backend_options(port, transport, RPC_WORKERS),
    )
    try:
        half = rows // RANKS
        results = {}
        local = table(rows)
        for size, dist, count in cases:
            batches = id_batches(rows, size, dist, count)
            run = lambda ids: _rpc_lookup(ids, half)  # noqa: E731
            ok = torch.equal(run(batches[0]), local[batches[0]])
            lat = latencies(run, batches)
            per_call = throughput(lambda: run, batches[: max(4, count // 4)], CLIENT_THREADS)
            results[(size, dist)] = (lat, per_call, ok)
        conn.send(results)
    finally:
        rpc.shutdown(graceful=True, timeout=600)


def run_rpc_baseline(rows: int, cases: list[tuple[int, str, int]], transport: str) -> dict:
    """Start two rpc servers and a client process over one TensorPipe transport; return the client's
    measurements {(size, dist): (latencies, seconds per call with 8 threads, matched)}."""
    from shardserve.server.launcher import free_port

    ctx = forkserver_context()
    port = free_port()
    servers = [
        ctx.Process(target=_rpc_server, args=(r, rows, port, transport), daemon=True)
        for r in range(1, RANKS + 1)
    ]
    parent, child = ctx.Pipe()
    client = ctx.Process(
        target=_rpc_client, args=(rows, port, transport, cases, child), daemon=True
    )
    for process in (*servers, client):
        process.start()
    try:
        if not parent.poll(1800):
            raise TimeoutError("the rpc baseline did not answer within 30 minutes")
        return parent.recv()
    finally:
        for process in (client, *servers):
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def rpc_row(case: str, seconds_by_transport: dict[str, float], ok: bool) -> Row:
    """The torch rpc baseline of one case: the faster TensorPipe transport's figure, both kept in extra."""
    fastest = fastest_transport(seconds_by_transport)
    return Row(
        "lookups",
        case,
        RPC,
        seconds_by_transport[fastest],
        path=f"tensorpipe {fastest}",
        role="baseline",
        ok=ok,
        extra={"seconds_by_transport": dict(seconds_by_transport)},
    )


# ---------------------------------------------------------------- scenarios

TRANSPORTS = ("grpc", "bulk", "auto")  # bulk: the bulk port, what a client on another host gets


def lookup_path(cluster: Any) -> str:
    """The path(s) the ranks' latest lookup answers took (client.embedding.lookup.Lookups.last_paths)."""
    return "+".join(sorted(set(cluster.lookups.last_paths.values()))) or "none"


@scenario(
    "lookups",
    help="embedding lookups (1/512/4096 ids, uniform/Zipf) vs torch.distributed.rpc and index_select",
)
def lookups_scenario(ctx: Context) -> list[Row]:
    from shardserve import connect

    rows_n = QUICK_ROWS if ctx.quick else ROWS
    source = table(rows_n)
    cases = [
        (size, dist, repeats(size, ctx.quick)) for size in BATCHES for dist in ("uniform", "zipf")
    ]
    rows: list[Row] = []
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, RANKS)
        remote = stack.enter_context(connect(cluster.address, transport="grpc")).put(
            "bench", source
        )
        ours = {}
        with ctx.rss(cluster.rank_pids) as peaks:
            for transport in TRANSPORTS:  # every data path, labelled with the one that answered
                reader = stack.enter_context(connect(cluster.address, transport=transport))
                remote = reader.tensor("bench")
                clients = [
                    stack.enter_context(connect(cluster.address, transport=transport))
                    for _ in range(CLIENT_THREADS)
                ]
                for size, dist, count in cases:
                    batches = id_batches(rows_n, size, dist, count)
                    ok = torch.equal(remote.lookup(batches[0]), source[batches[0]])
                    lat = latencies(remote.lookup, batches)
                    pool = iter(clients)
                    per_call = throughput(
                        lambda: next(pool).tensor("bench").lookup,
                        batches[: max(4, count // 4)],
                        CLIENT_THREADS,
                    )
                    ours[(transport, size, dist)] = (lat, per_call, ok, lookup_path(reader))
            for size, dist, count in cases:
                ours[(size, dist)] = latencies(
                    lambda ids: source.index_select(0, ids), id_batches(rows_n, size, dist, count)
                )
    theirs = {transport: run_rpc_baseline(rows_n, cases, transport) for transport in RPC_TRANSPORTS}
    for size, dist, _ in cases:
        local = ours[(size, dist)]
        rpc_ok = all(theirs[t][(size, dist)][2] for t in RPC_TRANSPORTS)
        for stat, q in (("p50", 0.5), ("p99", 0.99)):
            case = f"{size} ids {dist} {stat}"
            for transport in TRANSPORTS:
                lat, _, ok, path = ours[(transport, size, dist)]
                rows.append(
                    Row(
                        "lookups",
                        case,
                        f"{SHARDSERVE} ({transport})",
                        p(lat, q),
                        path=path,
                        baseline=RPC,
                        peak_rss=peaks,
                        ok=ok,
                    )
                )
            rows.append(
                rpc_row(case, {t: p(theirs[t][(size, dist)][0], q) for t in RPC_TRANSPORTS}, rpc_ok)
            )
            rows.append(
                Row("lookups", case, LOCAL, p(local, q), path="in-process", role="baseline")
            )
        case = f"{size} ids {dist} {CLIENT_THREADS} clients"
        for transport in TRANSPORTS:
            _, per_call, ok, path = ours[(transport, size, dist)]
            rows.append(
                Row(
                    "lookups",
                    case,
                    f"{SHARDSERVE} ({transport})",
                    per_call,
                    path=path,
                    baseline=RPC,
                    ok=ok,
                    extra={"rows_per_s": size / per_call},
                )
            )
        row = rpc_row(case, {t: theirs[t][(size, dist)][1] for t in RPC_TRANSPORTS}, rpc_ok)
        row.extra["rows_per_s"] = size / row.seconds
        rows.append(row)
    return rows


@scenario(
    "checkpoint",
    help="Cluster.load_checkpoint/save_checkpoint of a 1M x 64 table vs dcp.load/dcp.save",
)
def checkpoint_scenario(ctx: Context) -> list[Row]:
    import torch.distributed.checkpoint as dcp

    from shardserve import connect
    from shardserve.server.rank.jobs.checkpoint_reader import RegionReader

    rows_n = QUICK_ROWS if ctx.quick else ROWS
    source = table(rows_n)
    nbytes = source.numel() * 4
    repeat = 2 if ctx.quick else 5
    rows: list[Row] = []
    with ExitStack() as stack:
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardserve-bench-"))
        path = os.path.join(state, "table")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save({"bench": source}, checkpoint_id=path, no_dist=True)
            cluster = ctx.start_cluster(stack, RANKS)
            client = stack.enter_context(connect(cluster.address))
            load_times, dcp_times, direct_times, save_times, dcp_save_times = [], [], [], [], []
            with ctx.rss(cluster.rank_pids) as peaks:
                for i in range(repeat):
                    start = time.perf_counter()
                    client.load_checkpoint(path, overwrite=True)
                    load_times.append(time.perf_counter() - start)
                    out = {"bench": torch.empty(rows_n, DIM)}
                    start = time.perf_counter()
                    dcp.load(out, checkpoint_id=path, no_dist=True)
                    dcp_times.append(time.perf_counter() - start)
                    out_direct = {"bench": torch.empty(rows_n, DIM)}
                    start = time.perf_counter()
                    dcp.load(out_direct, storage_reader=RegionReader(path), no_dist=True)
                    direct_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    client.save_checkpoint(os.path.join(state, f"saved{i}"), names=["bench"])
                    save_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    dcp.save(
                        {"bench": source},
                        checkpoint_id=os.path.join(state, f"dcp{i}"),
                        no_dist=True,
                    )
                    dcp_save_times.append(time.perf_counter() - start)
            ok = (
                torch.equal(client["bench"][:], source)
                and torch.equal(out["bench"], source)
                and torch.equal(out_direct["bench"], source)
            )
    case = f"{rows_n} x {DIM} float32"
    rows.append(
        Row(
            "checkpoint",
            f"load {case}",
            "shardserve load_checkpoint",
            statistics.median(load_times),
            path="dcp on ranks",
            nbytes=nbytes,
            baseline="dcp.load",
            peak_rss=peaks,
            ok=ok,
        )
    )
    rows.append(
        Row(
            "checkpoint",
            f"load {case}",
            "dcp.load with RegionReader",
            statistics.median(direct_times),
            path="in-process",
            nbytes=nbytes,
            baseline="dcp.load",
            ok=ok,
        )
    )
    rows.append(
        Row(
            "checkpoint",
            f"load {case}",
            "dcp.load",
            statistics.median(dcp_times),
            path="in-process",
            role="baseline",
            nbytes=nbytes,
            ok=ok,
        )
    )
    rows.append(
        Row(
            "checkpoint",
            f"save {case}",
            "shardserve save_checkpoint",
            statistics.median(save_times),
            path="dcp on ranks",
            nbytes=nbytes,
            baseline="dcp.save",
            peak_rss=peaks,
        )
    )
    rows.append(
        Row(
            "checkpoint",
            f"save {case}",
            "dcp.save",
            statistics.median(dcp_save_times),
            path="in-process",
            role="baseline",
            nbytes=nbytes,
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.__main__ import main as suite_main

    return suite_main(
        ["--only", "lookups", "checkpoint", *(sys.argv[1:] if argv is None else argv)]
    )


if __name__ == "__main__":
    sys.exit(main())
