"""Scenario "fetch": RemoteShardedTensor.fetch of 1, 64 and 256 MiB boxes from a 2-rank LocalCluster.

Per box size, in the same run and on the same values: shardserve's fetch of
a box inside one shard and of a box straddling both ranks, for every
transport path `client.connect(..., transport=...)` offers (grpc, shm and bulk;
the row's path is the one the client reports in `last_transport`), against three baselines (benchmarks.baselines): a
raw TCP socket into a preallocated tensor (the reference of `ratio`),
torch.distributed.rpc of an RRef-held tensor's slice, and an in-process
memcpy. shardserve, the socket and memcpy take turns call by call (median of
each). torch rpc is timed first, in a phase of its own per TensorPipe
transport (shm and uv, the faster one is the row; the row's path says which),
by processes of their own that exist only while it is timed: its same-host
transport busy-polls a core in each of them. Every method's result is
checked against the source (`ok`), and each row reports the peak RSS of its
own server processes during its timed block.

    python -m benchmarks.fetch [--quick] [--json FILE]   (same as python -m benchmarks --only fetch)
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch

from benchmarks.baselines import (
    RPC_TRANSPORTS,
    RpcFetchBaseline,
    SocketServer,
    fastest_transport,
    memcpy,
    source_tensor,
)
from benchmarks.harness import Context, Row, scenario

GROUP = "fetch"
COLUMNS = 4096  # float32 columns: one row is 16 KiB
SIZES_MIB = (1, 64, 256)
QUICK_SIZES_MIB = (1,)
RANKS = 2
CALL_TIMEOUT_S = 120.0
SOCKET = "raw TCP socket"
RPC = "torch.distributed.rpc"
MEMCPY = "memcpy"


def transport_paths() -> tuple[str, ...]:
    """The transport paths `client.connect` can be asked for (each forced): just gRPC until it takes
    `transport=`, grpc and shm until it has the bulk TCP path (client.paths.policy)."""
    from shardserve import connect

    if "transport" not in inspect.signature(connect).parameters:
        return ("grpc",)
    try:
        from shardserve.client.paths.kinds import TRANSPORTS
    except ImportError:
        return ("grpc", "shm")
    return tuple(path for path in TRANSPORTS if path != "auto")


def connect_to(address: str, path: str):
    """A client connection forced onto `path` (plain `connect` when the client has no transport choice)."""
    from shardserve import connect

    if "transport" in inspect.signature(connect).parameters:
        return connect(address, timeout=CALL_TIMEOUT_S, transport=path)
    if path != "grpc":
        raise ValueError(f"connect() has no transport parameter; cannot use path {path!r}")
    return connect(address, timeout=CALL_TIMEOUT_S)


def path_that_ran(remote: object, requested: str) -> str:
    """The path the client reports for its last read (`last_transport`), else the one requested."""
    return getattr(remote, "last_transport", None) or requested


def repeats_for(nbytes: int, quick: bool) -> int:
    """Timed calls per method: more for small boxes, at least 3."""
    count = max(3, min(30, (512 << 20) // max(nbytes, 1)))
    return min(count, 3) if quick else count


def interleaved_medians(runs: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median wall time of each run over `repeat` rounds, after one warm-up each; the methods take turns
    call by call, so noise from the shared machine falls on all of them alike."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, spent in zip(runs, times):
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def box_rows(mib: int) -> int:
    return max(1, (mib << 20) // (COLUMNS * 4))


@scenario(
    "fetch",
    help="fetch of 1/64/256 MiB boxes from a 2-rank cluster vs raw socket, torch rpc, memcpy",
)
def fetch_scenario(ctx: Context) -> list[Row]:
    """Fetch boxes per transport path and per size, with the three baselines in the same run."""
    sizes = QUICK_SIZES_MIB if ctx.quick else SIZES_MIB
    shard_rows = box_rows(max(sizes))
    source = source_tensor(RANKS * shard_rows, COLUMNS)
    rpc_rows = rpc_fetch_rows(ctx, sizes, shard_rows)
    rows: list[Row] = []
    with ExitStack() as stack:
        sock = SocketServer(shard_rows, COLUMNS)
        stack.callback(sock.close)
        cluster = ctx.start_cluster(stack, RANKS)
        ctx.sampler.label(sock.pid, "socket server")
        sock.connect()
        remotes = {}
        for path in transport_paths():
            client = stack.enter_context(connect_to(cluster.address, path))
            remotes[path] = client.tensor("bench") if remotes else client.put("bench", source)
        for mib in sizes:
            rows += fetch_rows(
                ctx,
                mib,
                source=source,
                shard_rows=shard_rows,
                remotes=remotes,
                rank_pids=cluster.rank_pids,
                sock=sock,
            )
            rows.append(rpc_rows[mib])
    return rows


def rpc_fetch_rows(ctx: Context, sizes: tuple[int, ...], shard_rows: int) -> dict[int, Row]:
    """The torch rpc row per box size: each TensorPipe transport timed in its own phase, the faster one kept
    (the row's extra gives both)."""
    from shardserve.server.launcher import free_port

    measured: dict[str, tuple[list[tuple[float, bool]], dict[str, int]]] = {}
    plan = [(box_rows(mib), repeats_for(box_rows(mib) * COLUMNS * 4, ctx.quick)) for mib in sizes]
    for transport in RPC_TRANSPORTS:
        rpc = RpcFetchBaseline(shard_rows, COLUMNS, transport, free_port())
        try:
            ctx.sampler.label(rpc.pid, "rpc server")
            with ctx.rss([rpc.pid]) as peaks:
                results = rpc.measure(plan)
        finally:
            rpc.close()
        measured[transport] = (results, peaks)
    rows = {}
    for i, mib in enumerate(sizes):
        by_transport = {t: measured[t][0][i][0] for t in RPC_TRANSPORTS}
        fastest = fastest_transport(by_transport)
        rows[mib] = Row(
            GROUP,
            f"{mib} MiB",
            RPC,
            by_transport[fastest],
            path=f"tensorpipe {fastest}",
            role="baseline",
            nbytes=plan[i][0] * COLUMNS * 4,
            peak_rss=dict(measured[fastest][1]),
            ok=all(measured[t][0][i][1] for t in RPC_TRANSPORTS),
            extra={"repeat": plan[i][1], "seconds_by_transport": by_transport},
        )
    return rows


def fetch_rows(
    ctx: Context,
    mib: int,
    *,
    source: torch.Tensor,
    shard_rows: int,
    remotes: dict,
    rank_pids: list[int],
    sock: SocketServer,
) -> list[Row]:
    """shardserve, the socket and memcpy for one box size, timed in turns; the box starts at row 0 (one shard)
    or straddles the ranks. Each row's peak RSS is that of its own server processes over the whole timed block."""
    n = box_rows(mib)
    nbytes = n * COLUMNS * 4
    case = f"{mib} MiB"
    repeat = repeats_for(nbytes, ctx.quick)
    out = torch.empty(n, COLUMNS)
    leading = source[:n]
    straddle = shard_rows - n // 2
    methods = []  # (row name, path, role, pids, run, expected)
    for path, remote in remotes.items():
        for name, first in (
            ("shardserve fetch, 1 shard", 0),
            ("shardserve fetch, 2 shards", straddle),
        ):
            methods.append(
                (
                    name,
                    path,
                    "subject",
                    rank_pids,
                    lambda remote=remote, first=first: remote.fetch(
                        (first, 0), (n, COLUMNS), out=out
                    ),
                    source[first : first + n],
                )
            )
    methods += [
        (SOCKET, "tcp", "baseline", [sock.pid], lambda: sock.fetch(out), leading),
        (MEMCPY, "in-process", "baseline", [os.getpid()], lambda: memcpy(out, leading), leading),
    ]
    with ctx.rss() as peaks:
        seconds = interleaved_medians([m[4] for m in methods], repeat)
    rows = []
    for (name, path, role, pids, run, expected), spent in zip(methods, seconds):
        labels = {ctx.sampler.label_of(pid) for pid in pids}
        ran = path_that_ran(remotes[path], path) if role == "subject" else path
        rows.append(
            Row(
                GROUP,
                case,
                name,
                spent,
                path=ran,
                role=role,
                nbytes=nbytes,
                baseline=SOCKET if role == "subject" else None,
                peak_rss={k: v for k, v in peaks.items() if k in labels},
                ok=bool(torch.equal(run(), expected)),
                extra={"repeat": repeat},
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.__main__ import main as suite_main

    return suite_main(["--only", "fetch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
