"""Reshard across dims (Shard(0) -> Shard(1)) of a float32 tensor on 2 and 4 gloo ranks (127.0.0.1).

Methods, all run in the same worlds on the same data:

- bare transfer: `all_to_all_single` of flat buffers holding the same bytes
  into a preallocated output (the baseline; falls back to `batch_isend_irecv`
  of flat buffers if gloo refuses all_to_all_single, and the table says which),
- bare transfer + allocation: the same into a new output each call (what a
  reshard pays for its new shards: on Linux mostly page faults),
- shardserve: `plan_reshard` + `server.rank.jobs.reshard.run_reshard` on the
  collective thread (planning included in the time), new shards allocated,
- shardserve, out= recycled: the same writing into buffers allocated once,
  as the bare transfer does (a server reusing a dropped version's memory),
- `DTensor.redistribute(Shard(0) -> Shard(1))`,
- torch `ShardedTensor.reshard` to a ChunkShardingSpec on dim 1, where it runs.

Times are the slowest rank's per call; the methods take turns, repeat after
repeat (after one warm-up each), so load from elsewhere hits them alike; the
table shows the median and the best, "x bare" is median over median.

    python -m benchmarks.reshard [--size-mib 256] [--ranks 2,4] [--bucket-mib 16] [--repeats 3]
                                 [--methods bare,fresh,shardserve,recycled,dtensor,sharded] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.server.common.ports import free_port
from shardserve.server.rank_start import forkserver_context

BARE = "bare transfer"
BARE_FRESH = "bare transfer + allocation"
OURS = "shardserve run_reshard"
OURS_RECYCLED = "shardserve, out= recycled"
DTENSOR = "DTensor.redistribute"
SHARDED = "ShardedTensor.reshard"
PATTERN_MOD = 65521
METHOD_KEYS = {
    BARE: "bare",
    BARE_FRESH: "fresh",
    OURS: "shardserve",
    OURS_RECYCLED: "recycled",
    DTENSOR: "dtensor",
    SHARDED: "sharded",
}


def square_side(size_mib: float) -> int:
    """Side of the square float32 tensor of about size_mib MiB, a multiple of 4."""
    side = int(math.sqrt(size_mib * (1 << 20) / 4))
    return max(4, side - side % 4)


def pattern(rows: slice, cols: slice, n: int) -> torch.Tensor:
    """The benchmark tensor's block [rows, cols]: ((i * n + j) mod 65521) as float32."""
    i = torch.arange(rows.start, rows.stop, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(cols.start, cols.stop, dtype=torch.int64).unsqueeze(0)
    return ((i * n + j) % PATTERN_MOD).to(torch.float32)


def timed_once(fn: Callable[[], object]) -> float:
    """The slowest rank's wall time for one fn() call, started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bare_transfer(local: torch.Tensor, world: int) -> tuple[str, Callable[[], object]]:
    """A flat exchange of the same bytes: all_to_all_single, or batch_isend_irecv if gloo refuses it.

    The output buffer is allocated once, outside the timed call.
    """
    flat_in = local.reshape(-1).clone()
    flat_out = torch.empty_like(flat_in)
    try:
        dist.all_to_all_single(flat_out, flat_in)
        return "all_to_all_single", lambda: dist.all_to_all_single(flat_out, flat_in)
    except RuntimeError:
        pass
    rank, chunk = dist.get_rank(), flat_in.numel() // world
    pieces_in, pieces_out = flat_in.split(chunk), flat_out.split(chunk)

    def p2p() -> None:
        pieces_out[rank].copy_(pieces_in[rank])
        ops = [dist.P2POp(dist.isend, pieces_in[p], p) for p in range(world) if p != rank]
        ops += [dist.P2POp(dist.irecv, pieces_out[p], p) for p in range(world) if p != rank]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return "batch_isend_irecv", p2p


def shardserve_reshard(
    local: torch.Tensor,
    n: int,
    world: int,
    *,
    bucket_bytes: int,
    executor,
    seqs,
    recycle: bool = False,
):
    """plan_reshard + run_reshard of Shard(0) -> Shard(1) on the collective thread.

    With `recycle`, the new shard is written into one buffer allocated up front
    (as a server reusing a dropped version's memory would), like the bare
    transfer's preallocated output.
    """
    from shardserve.core.metadata import TensorProperties
    from shardserve.core.planner import plan_reshard_per_round
    from shardserve.core.specs import ChunkShardingSpec
    from shardserve.server.rank.jobs.reshard import ReshardStats, run_reshard

    rank = dist.get_rank()
    placements = [f"rank:{r}/cpu" for r in range(world)]
    src = ChunkShardingSpec(0, placements).build_metadata((n, n), TensorProperties())
    dst = ChunkShardingSpec(1, placements).build_metadata((n, n), TensorProperties())
    result = {}
    given = {rank: torch.empty(n, n // world)} if recycle else None

    def run() -> None:
        plan = plan_reshard_per_round(
            src, dst, bucket_bytes
        )  # as the cluster plans: staging <= 2 buckets
        stats = ReshardStats()
        future = executor.submit(
            next(seqs),
            lambda: run_reshard(plan, rank, {rank: local}, 600.0, stats=stats, out=given),
            wait_timeout_s=600,
        )
        result["out"] = future.result()[rank]
        result["extra_bytes"] = stats.new_shard_bytes + stats.peak_staging_bytes

    return run, result


def dtensor_redistribute(local: torch.Tensor, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    result = {}

    def run() -> None:
        out = dt.redistribute(mesh, [Shard(1)]).to_local()
        result["out"] = out.wait() if hasattr(out, "wait") else out

    return run, result


def sharded_tensor_reshard(local: torch.Tensor, n: int, world: int):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as StShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    rank = dist.get_rank()
    rows = n // world
    meta = ShardMetadata([rank * rows, 0], [rows, n], f"rank:{rank}/cpu")
    spec = ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in range(world)])
    result = {}

    def run() -> None:
        st = init_from_local_shards([StShard(local, meta)], [n, n])
        result["out"] = st.reshard(spec).local_shards()[0].tensor

    return run, result


def check_columns(out: torch.Tensor, n: int, world: int) -> bool:
    """Whether this rank's Shard(1) result holds exactly its columns of the benchmark tensor."""
    rank, cols = dist.get_rank(), n // world
    expected = pattern(slice(0, n), slice(rank * cols, (rank + 1) * cols), n)
    return out.shape == expected.shape and bool(torch.equal(out.contiguous(), expected))


def worker(rank: int, world: int, port: int, args: dict, results) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(intra_op_threads(world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    from shardserve.server.rank.jobs.ordering import CollectiveExecutor

    n = square_side(args["size_mib"])
    rows = n // world
    local = pattern(slice(rank * rows, (rank + 1) * rows), slice(0, n), n)
    executor = CollectiveExecutor()
    seqs = iter(range(1 << 30))
    try:
        rss_growth = peak_rss_growth(
            shardserve_reshard(
                local, n, world, bucket_bytes=args["bucket_bytes"], executor=executor, seqs=seqs
            )[0]
        )
        rows_out = run_methods(local, n, world, args, executor, seqs)
    finally:
        executor.close()
    growth = torch.tensor([rss_growth], dtype=torch.int64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(
            {
                "world": world,
                "n": n,
                "rows": rows_out,
                "shardserve_peak_rss_growth_bytes": growth.item(),
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def peak_rss_growth(fn: Callable[[], object], period_s: float = 0.0005) -> int:
    """Peak resident-set growth (bytes) of this process while fn() runs, sampled from /proc."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(period_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss()) - base


def intra_op_threads(world: int) -> int:
    """Cores per rank: ranks sharing a host must not oversubscribe it with intra-op threads."""
    return max(1, (os.cpu_count() or 1) // world)


def run_methods(local: torch.Tensor, n: int, world: int, args: dict, executor, seqs) -> list[dict]:
    """Time every method, interleaved repeat by repeat so load from elsewhere hits them alike."""
    flat_out = torch.empty_like(local).reshape(-1)
    note, bare = bare_transfer(local, world)
    methods = [
        (BARE, f"{note}, output preallocated", lambda: (bare, {})),
        (
            BARE_FRESH,
            "all_to_all_single into a new output each call",
            lambda: (
                lambda: dist.all_to_all_single(torch.empty_like(flat_out), local.reshape(-1)),
                {},
            ),
        ),
        (
            OURS,
            "",
            lambda: shardserve_reshard(
                local, n, world, bucket_bytes=args["bucket_bytes"], executor=executor, seqs=seqs
            ),
        ),
        (
            OURS_RECYCLED,
            "",
            lambda: shardserve_reshard(
                local,
                n,
                world,
                bucket_bytes=args["bucket_bytes"],
                executor=executor,
                seqs=seqs,
                recycle=True,
            ),
        ),
        (DTENSOR, "", lambda: dtensor_redistribute(local, world)),
        (SHARDED, "", lambda: sharded_tensor_reshard(local, n, world)),
    ]
    methods = [m for m in methods if METHOD_KEYS[m[0]] in args["methods"]]
    rows, runs = [], []
    for name, note, make in methods:
        row = {"method": name, "note": note, "times": [], "ok": True}
        try:
            run, result = make()
            run()  # warm-up, and the result checked below
        except Exception as exc:
            row.update(
                ok=False,
                note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}",
                trace=traceback.format_exc(limit=3),
            )
            run, result = None, {}
        if "out" in result:
            row["ok"] = all_ranks(check_columns(result.pop("out"), n, world))
        if "extra_bytes" in result:
            extra = torch.tensor([result["extra_bytes"]], dtype=torch.int64)
            dist.all_reduce(extra, op=dist.ReduceOp.MAX)
            row["extra_bytes_per_rank"] = extra.item()
            row["note"] = (
                f"peak extra {extra.item() / (1 << 20):.0f} MiB/rank (new shards + staging)"
            )
        rows.append(row)
        runs.append((run, result))
    for _ in range(args["repeats"]):
        for row, (run, result) in zip(rows, runs):
            if run is not None:
                row["times"].append(timed_once(run))
                result.clear()
    for row in rows:
        row["seconds"] = statistics.median(row["times"]) if row["times"] else None
        row["best"] = min(row["times"]) if row["times"] else None
    return rows


def all_ranks(flag: bool) -> bool:
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def run_world(world: int, args: dict) -> dict:
    ctx = forkserver_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + args["timeout"]
        while (
            True
        ):  # a worker that died (an exception, a kill) ends the wait at once, not at the timeout
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {world}-rank benchmark world failed (exit codes {failed}) "
                        f"or took over {args['timeout']:.0f} s"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def table(runs: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(
        title=f"Reshard Shard(0) -> Shard(1), float32, gloo on 127.0.0.1, {os.cpu_count()} cores, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
    )
    numeric = ("median s", "best s", "GB/s", "x bare")
    for column in ("ranks", "tensor", "method", *numeric, "correct", "note"):
        out.add_column(column, justify="right" if column in numeric else "left")
    for run in runs:
        bare = next(r["seconds"] for r in run["rows"] if r["method"] == BARE)
        nbytes = run["n"] * run["n"] * 4
        for r in run["rows"]:
            s = r["seconds"]
            out.add_row(
                str(run["world"]),
                f"{run['n']}x{run['n']} ({nbytes / (1 << 20):.0f} MiB)",
                r["method"],
                "-" if s is None else f"{s:.3f}",
                "-" if s is None else f"{r['best']:.3f}",
                "-" if s is None else f"{nbytes / s / 1e9:.2f}",
                "-" if s is None else f"{s / bare:.2f}",
                "yes" if r["ok"] else "no",
                r["note"],
            )
    Console(width=160).print(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib", type=float, default=256.0, help="tensor size in MiB (square float32)"
    )
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    parser.add_argument(
        "--bucket-mib", type=float, default=16.0, help="shardserve bucket size in MiB"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per world")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--methods",
        default=",".join(METHOD_KEYS.values()),
        help="comma-separated subset of: "
        + ", ".join(METHOD_KEYS.values())
        + " (bare always runs)",
    )
    ns = parser.parse_args(argv)
    args = {
        "size_mib": ns.size_mib,
        "bucket_bytes": int(ns.bucket_mib * (1 << 20)),
        "repeats": ns.repeats,
        "timeout": ns.timeout,
        "methods": sorted({"bare", *ns.methods.split(",")}),
    }
    unknown = set(args["methods"]) - set(METHOD_KEYS.values())
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}")
    runs = []
    for world in (int(w) for w in ns.ranks.split(",")):
        if square_side(ns.size_mib) % world:
            parser.error(
                f"--ranks {world} does not divide the tensor side {square_side(ns.size_mib)}"
            )
        runs.append(run_world(world, args))
    table(runs)
    for run in runs:
        print(
            f"{run['world']} ranks: shardserve peak RSS growth during one reshard (max over ranks, sampled): "
            f"{run['shardserve_peak_rss_growth_bytes'] / (1 << 20):.0f} MiB"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": args, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
