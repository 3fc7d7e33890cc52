"""Scenario "cuda": CUDA shards on a 1-rank LocalCluster (fetch into CUDA, CUDA IPC, pinned staging).

In the same run and on the same values:
- fetch of 1/64/256 MiB boxes into host memory over gRPC (the rank stages each
  box through pinned host memory) against an in-process device-to-host copy
  into pinned memory and into pageable memory;
- fetch of the same boxes into a CUDA tensor over the same-host path (the rank
  hands out CUDA IPC handles; the client copies device to device) against an
  in-process device-to-device copy;
- reshard of the whole tensor across dims on the GPU (3 row shards -> 2 column
  shards on one rank, all local copies) against the same copies done in-process.

On a machine without a CUDA GPU it returns one row saying so. With one GPU
NCCL cannot run two ranks (it refuses a duplicate GPU), so the transfers
between ranks over NCCL need a machine with 2 or more GPUs.

    python -m benchmarks --only cuda [--quick] [--json FILE]
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch

from benchmarks.fetch import (
    CALL_TIMEOUT_S,
    COLUMNS,
    box_rows,
    interleaved_medians,
    repeats_for,
)
from benchmarks.harness import Context, Row, scenario

GROUP_FETCH = "cuda-fetch"
GROUP_RESHARD = "cuda-reshard"
SIZES_MIB = (1, 64, 256)
QUICK_SIZES_MIB = (1,)
SHARDS = 3


@scenario(
    "cuda",
    help="fetch from CUDA shards (pinned staging, CUDA IPC) and an on-GPU reshard vs plain copies",
)
def cuda_scenario(ctx: Context) -> list[Row]:
    """Every row of this scenario, or one row saying why none ran."""
    if not torch.cuda.is_available():
        return [
            Row(
                GROUP_FETCH,
                "no CUDA GPU",
                "shardserve fetch",
                None,
                note="skipped: torch sees no CUDA GPU",
            )
        ]
    sizes = QUICK_SIZES_MIB if ctx.quick else SIZES_MIB
    total_rows = box_rows(max(sizes)) * 2
    source = torch.randn(total_rows, COLUMNS, generator=torch.Generator().manual_seed(7))
    on_gpu = source.cuda()
    rows: list[Row] = []
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, 1, device="cuda")
        from shardserve import connect
        from shardserve.core.specs import ChunkShardingSpec

        grpc_client = stack.enter_context(
            connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc")
        )
        ipc_client = stack.enter_context(
            connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="shm")
        )
        remote = grpc_client.put("gpu", source, ChunkShardingSpec(0, ["rank:0/cuda:0"] * SHARDS))
        mapped = ipc_client.tensor("gpu")
        for mib in sizes:
            rows += fetch_rows(ctx, mib, on_gpu, remote, mapped, cluster.rank_pids)
        rows += reshard_rows(ctx, on_gpu, remote, cluster.rank_pids)
    return rows


def fetch_rows(
    ctx: Context, mib: int, on_gpu: torch.Tensor, remote, mapped, rank_pids: list[int]
) -> list[Row]:
    """One box size: to host over gRPC vs device-to-host copies; to the GPU over CUDA IPC vs a device copy."""
    n = box_rows(mib)
    nbytes = n * COLUMNS * 4
    first = on_gpu.shape[0] // SHARDS - n // 2  # the box straddles two shards
    box = on_gpu[first : first + n]
    expected = box.cpu()
    to_host, pinned = torch.empty(n, COLUMNS), torch.empty(n, COLUMNS, pin_memory=True)
    to_gpu = torch.empty(n, COLUMNS, device="cuda")

    def synced(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    methods = [  # (group, name, path, role, run, result)
        (
            f"{mib} MiB to host",
            "shardserve fetch",
            "grpc",
            "subject",
            lambda: remote.fetch((first, 0), (n, COLUMNS), out=to_host),
            lambda: to_host,
        ),
        (
            f"{mib} MiB to host",
            "copy to pinned memory",
            "in-process",
            "baseline",
            synced(lambda: pinned.copy_(box)),
            lambda: pinned,
        ),
        (
            f"{mib} MiB to host",
            "copy to pageable memory",
            "in-process",
            "baseline",
            synced(lambda: to_host.copy_(box)),
            lambda: to_host,
        ),
        (
            f"{mib} MiB to GPU",
            "shardserve fetch",
            "shm",
            "subject",
            synced(lambda: mapped.fetch((first, 0), (n, COLUMNS), out=to_gpu)),
            lambda: to_gpu,
        ),
        (
            f"{mib} MiB to GPU",
            "device-to-device copy",
            "in-process",
            "baseline",
            synced(lambda: to_gpu.copy_(box)),
            lambda: to_gpu,
        ),
    ]
    with ctx.rss() as peaks:
        seconds = interleaved_medians([m[4] for m in methods], repeats_for(nbytes, ctx.quick))
    rows = []
    for (case, name, path, role, run, result), spent in zip(methods, seconds):
        run()
        pids = rank_pids if role == "subject" else [os.getpid()]
        labels = {ctx.sampler.label_of(pid) for pid in pids}
        ran = (remote if path == "grpc" else mapped).last_transport if role == "subject" else path
        rows.append(
            Row(
                GROUP_FETCH,
                case,
                name,
                spent,
                path=ran,
                role=role,
                nbytes=nbytes,
                peak_rss={k: v for k, v in peaks.items() if k in labels},
                ok=bool(torch.equal(result().cpu(), expected)),
            )
        )
    return rows


def reshard_rows(ctx: Context, on_gpu: torch.Tensor, remote, rank_pids: list[int]) -> list[Row]:
    """Rows -> columns on the GPU through the coordinator, against the same column copies in-process."""
    from shardserve.core.specs import ChunkShardingSpec

    nbytes = on_gpu.numel() * on_gpu.element_size()
    case = f"{nbytes >> 20} MiB rows->cols"
    halves = torch.tensor_split(torch.arange(on_gpu.shape[1]), 2)

    def in_process() -> list[torch.Tensor]:
        out = [on_gpu[:, cols[0] : cols[-1] + 1].contiguous() for cols in halves]
        torch.cuda.synchronize()
        return out

    layouts = (
        ChunkShardingSpec(1, ["rank:0/cuda:0"] * 2),
        ChunkShardingSpec(0, ["rank:0/cuda:0"] * SHARDS),
    )
    current = {"remote": remote, "turn": 0}

    def through_cluster() -> None:
        current["remote"] = current["remote"].reshard(layouts[current["turn"] % 2])
        current["turn"] += 1

    with ctx.rss() as peaks:
        ours, theirs = interleaved_medians([through_cluster, in_process], 2 if ctx.quick else 4)
    labels = {ctx.sampler.label_of(pid) for pid in rank_pids}
    ok = bool(torch.equal(current["remote"].full_tensor().cpu(), on_gpu.cpu()))
    return [
        Row(
            GROUP_RESHARD,
            case,
            "shardserve reshard (1 rank, CUDA)",
            ours,
            path="cuda",
            nbytes=nbytes,
            peak_rss={k: v for k, v in peaks.items() if k in labels},
            ok=ok,
            note="each run alternates rows->cols and cols->rows",
        ),
        Row(
            GROUP_RESHARD,
            case,
            "in-process column copies",
            theirs,
            path="in-process",
            role="baseline",
            nbytes=nbytes,
            ok=True,
        ),
    ]
