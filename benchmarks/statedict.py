"""State dicts of SPMD jobs: a 2-process trainer (Shard(0)) puts, a 2-process inference job (Shard(1) and
Replicate) gets, against dcp.save + dcp.load through the filesystem and the bare transfer of the same bytes
(a memory copy and a loopback socket).

Two cases: 64 tensors of 1 GiB in all (bandwidth), and 512 tensors of 8 KiB (per-tensor overhead: a state dict
of hundreds of small tensors must not be dominated by it). The trainer puts three times (keep=1): the first put
is timed into new rank memory, the third into the buffers the second one's commit freed (a weight sync's steady
state). One 4-process gloo world on this host and one 2-rank
cluster for both cases: ranks 0-1 are the trainer, ranks 2-3 the inference job, each on its own group and mesh.
torchstore's published figures (0.4 s put / 2.8 s get for Qwen3-32B with CPU staging, pytorch/torchstore
issue 175) are quoted in docs/performance.md, not measured here.

    python -m benchmarks --only statedict
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from benchmarks.harness import Context, Row, scenario
from benchmarks.statedict_casts import cast_rows
from benchmarks.statedict_delta import delta_rows
from benchmarks.statedict_fsdp import fsdp_rows
from benchmarks.statedict_host import host_rows
from benchmarks.statedict_verify import verify_rows
from shardserve.server.rank_start import forkserver_context

CASES = ((64, 1 << 30), (512, 512 * 8192))  # (tensors, bytes in all)
QUICK_CASES = ((64, 4 << 20), (128, 128 * 8192))


def _state(count: int, total_bytes: int, mesh: Any, placements_of: Any) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    rows = max(2, int((total_bytes // count // 4) ** 0.5))
    return {
        f"layer{i}.w": distribute_tensor(torch.full((rows, rows), float(i)), mesh, placements_of(i))
        for i in range(count)
    }


def _job(
    rank: int,
    port: int,
    address: str,
    cases: tuple[tuple[int, int], ...],
    folder: str,
    results: Any,
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from shardserve import connect

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=4,
        timeout=timedelta(seconds=600),
    )
    groups = (dist.new_group([0, 1]), dist.new_group([2, 3]))
    meshes = (DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3]))
    cluster, paths = connect(address), {}
    write_shards = cluster.session.write_shards
    cluster.session.write_shards = lambda writes: paths.update(write_shards(writes)) or paths
    for index, (count, total_bytes) in enumerate(cases):
        paths.clear()
        times, ok = _case(
            rank,
            cluster,
            prefix=f"bench{index}",
            count=count,
            total_bytes=total_bytes,
            folder=f"{folder}/{index}",
            groups=groups,
            meshes=meshes,
        )
        results.put((index, rank, times, ok, "+".join(sorted(paths))))
    cluster.close()
    dist.destroy_process_group()


def _case(
    rank: int,
    cluster: Any,
    *,
    prefix: str,
    count: int,
    total_bytes: int,
    folder: str,
    groups: Any,
    meshes: Any,
) -> tuple[dict[str, float], bool]:
    """One case on this process: the trainer (ranks 0-1) puts and dcp.saves, the inference job (2-3) gets and
    dcp.loads; seconds of each step as this process saw them, and whether its shards came back right."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard

    from shardserve import spmd

    trainer, inference = groups
    group = trainer if rank < 2 else inference
    if rank < 2:
        state = _state(count, total_bytes, meshes[0], lambda i: [Shard(0)])
    else:
        state = _state(
            count, total_bytes, meshes[1], lambda i: [Shard(1)] if i % 2 else [Replicate()]
        )
    out = {}
    for what in ("put", "put again", "put steady", "get", "dcp.save", "dcp.load"):
        dist.barrier()
        start = time.perf_counter()
        if (
            what.startswith("put") and rank < 2
        ):  # keep=1: the third put reuses the buffers the second one freed
            spmd.put_state_dict(cluster, state, prefix, group=trainer, keep=1)
        elif what == "get" and rank >= 2:
            spmd.get_state_dict(cluster, prefix, into=state, group=inference)
        elif what == "dcp.save" and rank < 2:
            dcp.save(state, checkpoint_id=folder, process_group=group)
        elif what == "dcp.load" and rank >= 2:
            dcp.load(state, checkpoint_id=folder, process_group=group)
        dist.barrier(group)
        out[what] = time.perf_counter() - start
    ok = all(
        torch.equal(v.to_local(), torch.full_like(v.to_local(), float(i)))
        for i, v in enumerate(state.values())
    )
    return out, ok


def _socket_s(total_bytes: int) -> float:
    """Seconds to move `total_bytes` from one buffer to another over a loopback TCP connection."""
    source = torch.ones(total_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()

        def receive() -> None:
            view, done = memoryview(target.numpy()), 0
            while done < total_bytes:
                done += receiver.recv_into(view[done:])

        thread = threading.Thread(target=receive)
        start = time.perf_counter()
        thread.start()
        sender.sendall(memoryview(source.numpy()))
        thread.join()
        seconds = time.perf_counter() - start
        sender.close()
        receiver.close()
    return seconds


def _copy_s(total_bytes: int) -> float:
    """Seconds of one in-process copy of `total_bytes` into cold pages."""
    source = torch.ones(total_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    start = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - start


def run(address: str, cases: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    """Per case: seconds of put (trainer), get (inference), dcp.save, dcp.load, a bare copy and a socket
    transfer, the write path and whether every shard came back right (one 4-process world for all cases)."""
    from shardserve.server.launcher import free_port

    ctx = forkserver_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-dcp-") as folder:
        port = free_port()
        procs = [
            ctx.Process(target=_job, args=(r, port, address, cases, folder, results))
            for r in range(4)
        ]
        for p in procs:
            p.start()
        answers = [results.get(timeout=900) for _ in range(4 * len(cases))]
        for p in procs:
            p.join(timeout=30)
    out = []
    for index, (_, total_bytes) in enumerate(cases):
        by_rank = {rank: (times, paths) for i, rank, times, _, paths in answers if i == index}
        out.append(
            {
                "put_s": by_rank[0][0]["put"],
                "put_steady_s": by_rank[0][0]["put steady"],
                "get_s": by_rank[2][0]["get"],
                "dcp_save_s": by_rank[0][0]["dcp.save"],
                "dcp_load_s": by_rank[2][0]["dcp.load"],
                "copy_s": _copy_s(total_bytes),
                "socket_s": _socket_s(total_bytes),
                "write_path": by_rank[0][1] or "none",
                "ok": all(ok for i, _, _, ok, _ in answers if i == index),
            }
        )
    return out


@scenario(
    "statedict",
    help="SPMD state dict put/get (2 -> 2 processes) vs dcp.save/load and bare transfers",
)
def statedict_scenario(ctx: Context) -> list[Row]:
    """A 2-process trainer puts, a 2-process inference job gets, for a few large and many small tensors."""
    from contextlib import ExitStack

    cases = QUICK_CASES if ctx.quick else CASES
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, ranks=2)
        with ctx.rss() as peaks:
            measured = run(cluster.address, cases)
    with (
        ExitStack() as stack
    ):  # a fresh cluster: the first puts below meet idle ranks with no memory held
        cluster = ctx.start_cluster(stack, ranks=2)
        with ctx.rss() as host_peaks:
            host = host_rows(cluster, quick=ctx.quick, peaks={})
            host += fsdp_rows(cluster.address, quick=ctx.quick, peaks={})
            host += cast_rows(cluster, quick=ctx.quick)
            host += delta_rows(cluster, quick=ctx.quick)
            host += verify_rows(cluster, quick=ctx.quick)
        for row in host:
            if row.role == "subject":
                row.peak_rss = host_peaks
    rows = []
    for (count, total), r in zip(cases, measured):
        case = f"{count} tensors, {total >> 10} KiB"
        per_tensor = {
            "per_tensor_ms": {
                what: 1e3 * r[f"{what}_s"] / count
                for what in ("put", "get", "dcp_save", "dcp_load")
            }
        }
        rows += [
            Row(
                "statedict",
                case,
                "spmd.put_state_dict",
                r["put_s"],
                path=r["write_path"],
                nbytes=total,
                ok=r["ok"],
                baseline="dcp.save",
                peak_rss=peaks,
                extra=per_tensor,
                note="first put: the ranks' memory is new",
            ),
            Row(
                "statedict",
                case,
                "spmd.put_state_dict (steady)",
                r["put_steady_s"],
                path=r["write_path"],
                nbytes=total,
                ok=r["ok"],
                baseline="dcp.save",
                peak_rss=peaks,
                note="third put, keep=1: into buffers the previous snapshot freed",
            ),
            Row(
                "statedict",
                case,
                "spmd.get_state_dict",
                r["get_s"],
                path="auto",
                nbytes=total,
                ok=r["ok"],
                baseline="dcp.load",
                peak_rss=peaks,
            ),
            Row(
                "statedict",
                case,
                "dcp.save",
                r["dcp_save_s"],
                path="filesystem",
                role="baseline",
                nbytes=total,
            ),
            Row(
                "statedict",
                case,
                "dcp.load",
                r["dcp_load_s"],
                path="filesystem",
                role="baseline",
                nbytes=total,
            ),
            Row(
                "statedict",
                case,
                "bare copy",
                r["copy_s"],
                path="memory",
                role="baseline",
                nbytes=total,
            ),
            Row(
                "statedict",
                case,
                "bare socket",
                r["socket_s"],
                path="loopback tcp",
                role="baseline",
                nbytes=total,
            ),
        ]
    return rows + host
