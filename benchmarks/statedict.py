"""State dicts of SPMD jobs: a 2-process trainer (Shard(0)) puts, a 2-process inference job (Shard(1) and
Replicate) gets, against dcp.save + dcp.load through the filesystem and a bare copy of the same bytes.

One 4-process gloo world on this host: ranks 0-1 are the trainer, ranks 2-3 the inference job, each on its
own group and mesh. torchstore's published figures (0.4 s put / 2.8 s get for Qwen3-32B with CPU staging,
pytorch/torchstore issue 175) are quoted in docs/performance.md, not measured here.

    python -m benchmarks --only statedict
"""
from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from benchmarks.harness import Context, Row, scenario

TENSORS = 64


def _state(total_bytes: int, mesh: Any, placements_of: Any) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor
    rows = max(2, int((total_bytes // TENSORS // 4) ** 0.5))
    return {f"layer{i}.w": distribute_tensor(torch.full((rows, rows), float(i)), mesh, placements_of(i))
            for i in range(TENSORS)}


def _job(rank: int, port: int, address: str, total_bytes: int, folder: str, results: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    from client import connect, spmd
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=600))
    trainer, inference = dist.new_group([0, 1]), dist.new_group([2, 3])
    meshes = {"t": DeviceMesh("cpu", [0, 1]), "i": DeviceMesh("cpu", [2, 3])}
    group = trainer if rank < 2 else inference
    cluster, out = connect(address), {}
    if rank < 2:
        state = _state(total_bytes, meshes["t"], lambda i: [Shard(0)])
    else:
        state = _state(total_bytes, meshes["i"], lambda i: [Shard(1)] if i % 2 else [Replicate()])
    for what in ("put", "get", "dcp.save", "dcp.load"):
        dist.barrier()
        start = time.perf_counter()
        if what == "put" and rank < 2:
            spmd.put_state_dict(cluster, state, "bench", group=trainer)
        elif what == "get" and rank >= 2:
            spmd.get_state_dict(cluster, "bench", into=state, group=inference)
        elif what == "dcp.save" and rank < 2:
            dcp.save(state, checkpoint_id=folder, process_group=group)
        elif what == "dcp.load" and rank >= 2:
            dcp.load(state, checkpoint_id=folder, process_group=group)
        dist.barrier(group)
        out[what] = time.perf_counter() - start
    ok = all(torch.equal(v.to_local(), torch.full_like(v.to_local(), float(i))) for i, v in enumerate(state.values()))
    results.put((rank, out, ok))
    cluster.close()
    dist.destroy_process_group()


def run(address: str, total_bytes: int) -> dict[str, Any]:
    """Seconds of put (trainer), get (inference), dcp.save, dcp.load and a bare copy of the same bytes."""
    import torch.multiprocessing as mp

    from server.launcher import free_port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-dcp-") as folder:
        port = free_port()
        procs = [ctx.Process(target=_job, args=(r, port, address, total_bytes, folder, results)) for r in range(4)]
        for p in procs:
            p.start()
        answers = [results.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    source = torch.empty(total_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    start = time.perf_counter()
    target.copy_(source)
    copy_s = time.perf_counter() - start
    by_rank = {rank: times for rank, times, _ in answers}
    return {"put_s": by_rank[0]["put"], "get_s": by_rank[2]["get"], "dcp_save_s": by_rank[0]["dcp.save"],
            "dcp_load_s": by_rank[2]["dcp.load"], "copy_s": copy_s, "ok": all(ok for _, _, ok in answers)}


@scenario("statedict", help="SPMD state dict put/get (2 -> 2 processes) vs dcp.save/load and a bare copy")
def statedict_scenario(ctx: Context) -> list[Row]:
    """A 2-process trainer puts, a 2-process inference job gets: 4 MiB quick, 1 GiB otherwise."""
    from contextlib import ExitStack

    total = (4 << 20) if ctx.quick else (1 << 30)
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, ranks=2)
        with ctx.rss() as peaks:
            r = run(cluster.address, total)
    case = f"{TENSORS} tensors, {total >> 20} MiB"
    return [Row("statedict", case, "spmd.put_state_dict", r["put_s"], path="grpc", nbytes=total, ok=r["ok"],
                baseline="dcp.save", peak_rss=peaks),
            Row("statedict", case, "spmd.get_state_dict", r["get_s"], path="auto", nbytes=total, ok=r["ok"],
                baseline="dcp.load", peak_rss=peaks),
            Row("statedict", case, "dcp.save", r["dcp_save_s"], path="filesystem", role="baseline", nbytes=total),
            Row("statedict", case, "dcp.load", r["dcp_load_s"], path="filesystem", role="baseline", nbytes=total),
            Row("statedict", case, "bare copy", r["copy_s"], path="memory", role="baseline", nbytes=total)]
