"""Scenario "cuda": CUDA tensors and shards on this host's GPU against the copies a single process would make.

In the same run and on the same values:
- 1 rank on cuda:0 (3 row shards): fetch of 1/64/256 MiB boxes into host memory over gRPC (the rank stages
  each box through pinned host memory) against in-process device-to-host copies into pinned and pageable
  memory; fetch of the same boxes into a CUDA tensor over the same-host path (CUDA IPC) against a
  device-to-device copy; a reshard rows -> columns on the GPU inside the rank against the same column copies
  in-process; a steady put and get of a 1 GiB CUDA state dict against device-to-device copies
  (benchmarks.cuda_statedict); `RemoteEmbeddingBag` with CUDA ids against `nn.EmbeddingBag` on the GPU
  (benchmarks.cuda_lookups);
- 2 CPU ranks: the same state dict against copies to and from pinned memory; fetch of the largest box from
  CPU shards into a CUDA tensor against a copy from pinned memory; `RemoteEmbeddingBag` over CPU shards;
- 2 ranks on the same GPU (`up --ranks 2 --device cuda:0`): a reshard rows -> columns between them against
  the in-process column copies (a reshard that fails is a row saying why).

Rows carry the targets the project set (`Target`), printed beside their ratios, never asserted. Sizes shrink
with --quick, and SHARDSERVE_BENCH_CUDA_MIB caps the state dict and the boxes (the reshards move twice the
largest box) for a short run. On a machine without a CUDA GPU it returns one row saying so.

    python -m benchmarks --only cuda [--quick] [--json FILE]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks.baselines import median_seconds
from benchmarks.cuda_lookups import bag_rows, bag_table
from benchmarks.cuda_statedict import state_dict_rows, synced
from benchmarks.fetch import (
    CALL_TIMEOUT_S,
    COLUMNS,
    box_rows,
    interleaved_medians,
    repeats_for,
)
from benchmarks.harness import Context, Row, Target, failure_row, scenario

log = logging.getLogger(__name__)

GROUP_FETCH = "cuda-fetch"
GROUP_RESHARD = "cuda-reshard"
SHARDS = 3
MiB = 1 << 20
CAP_ENV = "SHARDSERVE_BENCH_CUDA_MIB"
FETCH_TARGET = Target(min_ratio=0.5)  # of the device-to-device copy, at the largest box (256 MiB)
ONE_RANK_RESHARD_TARGET = Target(min_ratio=0.5)  # of the in-process column copies
TWO_RANK_RESHARD_TARGET = Target(min_ratio=1 / 3)  # within 3x of the in-process column copies
ONE_GPU = "cuda:0"
ONE_RANK, TWO_RANKS = "1 rank on cuda:0", "2 ranks on cuda:0"
RESHARD_TIMEOUT_S = 30.0  # a reshard that hangs fails its row, not the whole run's time limit


@dataclass(frozen=True)
class CudaSizes:
    """How big each case of the scenario is."""

    state_tensors: int
    state_tensor_bytes: int
    fetch_mib: tuple[int, ...]
    bag_rows: int
    bag_dim: int
    bag_batch: int
    bag_size: int
    repeats: int


FULL = CudaSizes(64, 16 * MiB, (1, 64, 256), 1_000_000, 128, 2048, 20, 5)
QUICK = CudaSizes(8, MiB, (1,), 100_000, 128, 256, 20, 3)


def cuda_sizes(quick: bool) -> CudaSizes:
    """FULL or QUICK, the state dict and the boxes capped at $SHARDSERVE_BENCH_CUDA_MIB MiB when it is set."""
    sizes = QUICK if quick else FULL
    cap = os.environ.get(CAP_ENV)
    if not cap:
        return sizes
    if not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"{CAP_ENV} must be a whole number of MiB >= 1, got {cap!r}")
    cap_mib = int(cap)
    each = min(sizes.state_tensor_bytes, max(MiB, cap_mib * MiB // sizes.state_tensors))
    fetch = tuple(m for m in sizes.fetch_mib if m <= cap_mib) or (min(sizes.fetch_mib),)
    return replace(sizes, state_tensor_bytes=each // MiB * MiB, fetch_mib=fetch)


@scenario(
    "cuda",
    help="CUDA state dicts, fetches, reshards and GPU lookups through ranks on this host vs plain copies",
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
    sizes = cuda_sizes(ctx.quick)
    total_rows = box_rows(max(sizes.fetch_mib)) * 2
    source = torch.randn(total_rows, COLUMNS, generator=torch.Generator().manual_seed(7))
    on_gpu = source.cuda()
    table = bag_table(sizes.bag_rows, sizes.bag_dim)
    phases: list[tuple[str, Callable[[], list[Row]]]] = [
        (ONE_RANK, lambda: one_cuda_rank_rows(ctx, sizes, source, on_gpu, table)),
        ("2 CPU ranks", lambda: cpu_rank_rows(ctx, sizes, source, table)),
        (TWO_RANKS, lambda: two_ranks_one_gpu_rows(ctx, source, on_gpu)),
    ]
    rows: list[Row] = []
    for cluster, phase in phases:  # a cluster that fails is a row; the other clusters' rows stay
        try:
            rows += phase()
        except Exception as exc:
            log.exception("cuda scenario: the %s cluster failed", cluster)
            rows.append(failure_row(GROUP_FETCH, cluster, "cluster", exc))
    return rows


def one_cuda_rank_rows(
    ctx: Context, sizes: CudaSizes, source: torch.Tensor, on_gpu: torch.Tensor, table: torch.Tensor
) -> list[Row]:
    """Fetches, the on-GPU reshard, the state dict and the lookups of a 1-rank cluster on cuda:0."""
    from shardserve import connect
    from shardserve.core.specs import ChunkShardingSpec

    rows: list[Row] = []
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, 1, device="cuda")
        grpc_client = stack.enter_context(
            connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc")
        )
        ipc_client = stack.enter_context(
            connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="shm")
        )
        client = stack.enter_context(connect(cluster.address, timeout=CALL_TIMEOUT_S))
        on_rank = f"rank:0/{ONE_GPU}"
        remote = grpc_client.put("gpu", source, ChunkShardingSpec(0, [on_rank] * SHARDS))
        mapped = ipc_client.tensor("gpu")
        for mib in sizes.fetch_mib:
            target = FETCH_TARGET if mib == max(sizes.fetch_mib) else None
            rows += fetch_rows(ctx, mib, on_gpu, remote, mapped, cluster.rank_pids, target=target)
        layouts = (ChunkShardingSpec(1, [on_rank] * 2), ChunkShardingSpec(0, [on_rank] * SHARDS))
        with ctx.rss(cluster.rank_pids) as peaks:
            rows += reshard_rows(
                on_gpu,
                remote,
                layouts,
                name="shardserve reshard (1 rank, CUDA)",
                ranks=ONE_RANK,
                target=ONE_RANK_RESHARD_TARGET,
                quick=ctx.quick,
                peaks=peaks,
            )
        grpc_client.delete("gpu")
        with ctx.rss(cluster.rank_pids) as peaks:
            rows += state_dict_rows(client, "CUDA ranks", **state_dict_sizes(sizes), peaks=peaks)
        rows += bag_rows(
            grpc_client,
            client,
            table,
            ChunkShardingSpec(0, [on_rank] * 2),
            ranks="CUDA ranks",
            **bag_sizes(sizes, ctx.quick),
        )
    return rows


def cpu_rank_rows(
    ctx: Context, sizes: CudaSizes, source: torch.Tensor, table: torch.Tensor
) -> list[Row]:
    """The state dict, a fetch into a CUDA tensor and the lookups through 2 CPU ranks."""
    from shardserve import connect
    from shardserve.core.specs import ChunkShardingSpec

    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    rows: list[Row] = []
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, 2)
        client = stack.enter_context(connect(cluster.address, timeout=CALL_TIMEOUT_S))
        with ctx.rss(cluster.rank_pids) as peaks:
            rows += state_dict_rows(client, "CPU ranks", **state_dict_sizes(sizes), peaks=peaks)
        rows += cpu_shard_fetch_rows(
            client, source, spec, mib=max(sizes.fetch_mib), quick=ctx.quick
        )
        rows += bag_rows(
            client, client, table, spec, ranks="CPU ranks", **bag_sizes(sizes, ctx.quick)
        )
    return rows


def two_ranks_one_gpu_rows(ctx: Context, source: torch.Tensor, on_gpu: torch.Tensor) -> list[Row]:
    """A reshard between 2 ranks on cuda:0 (NCCL refuses two ranks on one GPU; same-host copies need not)."""
    from shardserve import connect
    from shardserve.core.specs import ChunkShardingSpec

    placements = [f"rank:0/{ONE_GPU}", f"rank:1/{ONE_GPU}"]
    name = "shardserve reshard (2 ranks, one GPU)"
    with ExitStack() as stack:
        cluster = ctx.start_cluster(stack, 2, device=ONE_GPU)
        client = stack.enter_context(
            connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc")
        )
        try:
            remote = client.put("gpu2", source, ChunkShardingSpec(0, placements))
        except Exception as exc:
            case = reshard_case(on_gpu, TWO_RANKS)
            return [failure_row(GROUP_RESHARD, case, name, exc, target=TWO_RANK_RESHARD_TARGET)]
        layouts = (ChunkShardingSpec(1, placements), ChunkShardingSpec(0, placements))
        with ctx.rss(cluster.rank_pids) as peaks:
            return reshard_rows(
                on_gpu,
                remote,
                layouts,
                name=name,
                ranks=TWO_RANKS,
                target=TWO_RANK_RESHARD_TARGET,
                quick=ctx.quick,
                peaks=peaks,
            )


def state_dict_sizes(sizes: CudaSizes) -> dict[str, int]:
    return {
        "count": sizes.state_tensors,
        "each_bytes": sizes.state_tensor_bytes,
        "repeats": sizes.repeats,
    }


def bag_sizes(sizes: CudaSizes, quick: bool) -> dict[str, Any]:
    return {"batch": sizes.bag_batch, "bag": sizes.bag_size, "quick": quick}


def fetch_rows(
    ctx: Context,
    mib: int,
    on_gpu: torch.Tensor,
    remote,
    mapped,
    rank_pids: list[int],
    *,
    target: Target | None = None,
) -> list[Row]:
    """One box size: to host over gRPC vs device-to-host copies; to the GPU over CUDA IPC vs a device copy
    (`target` for the latter)."""
    n = box_rows(mib)
    nbytes = n * COLUMNS * 4
    first = on_gpu.shape[0] // SHARDS - n // 2  # the box straddles two shards
    box = on_gpu[first : first + n]
    expected = box.cpu()
    to_host, pinned = torch.empty(n, COLUMNS), torch.empty(n, COLUMNS, pin_memory=True)
    to_gpu = torch.empty(n, COLUMNS, device="cuda")
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
                target=target if path == "shm" else None,
            )
        )
    return rows


def cpu_shard_fetch_rows(
    cluster: Any, source: torch.Tensor, spec: Any, *, mib: int, quick: bool
) -> list[Row]:
    """A box straddling two CPU ranks' shards fetched into a CUDA tensor, against a copy of the same bytes
    from pinned host memory."""
    n = box_rows(mib)
    nbytes = n * COLUMNS * 4
    first = source.shape[0] // 2 - n // 2
    expected = source[first : first + n]
    pinned, to_gpu = expected.contiguous().pin_memory(), torch.empty(n, COLUMNS, device="cuda")
    case, name, limit = (
        f"{mib} MiB from CPU shards to GPU",
        "shardserve fetch",
        "copy from pinned memory",
    )
    try:
        remote = cluster.put("cpu-shards", source, spec, overwrite=True, durable=False)
        ours = synced(lambda: remote.fetch((first, 0), (n, COLUMNS), out=to_gpu))
        spent = interleaved_medians(
            [ours, synced(lambda: to_gpu.copy_(pinned, non_blocking=True))],
            repeats_for(nbytes, quick),
        )
    except Exception as exc:
        return [failure_row(GROUP_FETCH, case, name, exc, baseline=limit, nbytes=nbytes)]
    ours()
    return [
        Row(
            GROUP_FETCH,
            case,
            name,
            spent[0],
            path=remote.last_transport,
            nbytes=nbytes,
            ok=bool(torch.equal(to_gpu.cpu(), expected)),
        ),
        Row(GROUP_FETCH, case, limit, spent[1], path="in-process", role="baseline", nbytes=nbytes),
    ]


def reshard_case(on_gpu: torch.Tensor, ranks: str) -> str:
    """The case of a reshard of `on_gpu`'s bytes on `ranks` (each case has its own in-process limit)."""
    return f"{on_gpu.numel() * on_gpu.element_size() >> 20} MiB rows->cols, {ranks}"


def reshard_rows(
    on_gpu: torch.Tensor,
    remote: Any,
    layouts: tuple[Any, Any],
    *,
    name: str,
    ranks: str,
    target: Target,
    quick: bool,
    peaks: dict[str, int],
) -> list[Row]:
    """Reshards through the coordinator, alternating between `layouts` (columns, then rows), against the same
    column copies in-process; a reshard that fails is a row holding its error. `peaks`: the ranks' RSS
    window."""
    nbytes = on_gpu.numel() * on_gpu.element_size()
    case = reshard_case(on_gpu, ranks)
    halves = torch.tensor_split(torch.arange(on_gpu.shape[1]), 2)
    repeats = 2 if quick else 4

    def in_process() -> list[torch.Tensor]:
        out = [on_gpu[:, cols[0] : cols[-1] + 1].contiguous() for cols in halves]
        torch.cuda.synchronize()
        return out

    current = {"remote": remote, "turn": 0}

    def through_cluster() -> None:
        turn = layouts[current["turn"] % 2]
        current["remote"] = current["remote"].reshard(turn, timeout=RESHARD_TIMEOUT_S)
        current["turn"] += 1

    limit = Row(
        GROUP_RESHARD,
        case,
        "in-process column copies",
        None,
        path="in-process",
        role="baseline",
        nbytes=nbytes,
        ok=True,
    )
    try:
        ours, limit.seconds = interleaved_medians([through_cluster, in_process], repeats)
    except Exception as exc:
        limit.seconds = median_seconds(in_process, repeats)
        return [failure_row(GROUP_RESHARD, case, name, exc, nbytes=nbytes, target=target), limit]
    ok = bool(torch.equal(current["remote"].full_tensor().cpu(), on_gpu.cpu()))
    row = Row(
        GROUP_RESHARD,
        case,
        name,
        ours,
        path="cuda",
        nbytes=nbytes,
        peak_rss=peaks,
        ok=ok,
        target=target,
        note="each run alternates rows->cols and cols->rows",
    )
    return [row, limit]
