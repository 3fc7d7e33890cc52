"""Client side of coordinated resharding: the streaming Reshard call and the CLI's layout syntax.

`reshard(session, name, shape, dtype, spec, ...)` asks the coordinator to
move a tensor into the layout `spec` (anything `Cluster.put` accepts) and
follows the progress stream; the result is the new version's catalog entry. `layout_from_options`
turns the CLI's small syntax (`--dim D [--ranks 0,2]`, `--grid 2x2
[--grid-dims 0,1]`, `--replicate [--ranks ...]`) into shard metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.errors import InvalidArgumentError, ShardServeError
from shardserve.client.info import TensorSummary
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.placements import Replicate, Shard, metadata_from_placements
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason

DEFAULT_TIMEOUT_S = 300.0
PHASES = {
    pb.RESHARD_PREPARING: "preparing",
    pb.RESHARD_MOVING: "moving",
    pb.RESHARD_COMMITTING: "committing",
    pb.RESHARD_DONE: "done",
}


class ReshardRefusedError(ShardServeError, RuntimeError):
    """The coordinator refused or could not finish a reshard: one is running (TENSOR_BUSY), a rank is down
    (RankUnavailableError instead), a box has no live copy (SHARDS_LOST) or a promotion is unfinished; `reason`
    says which."""


REFUSED_REASONS = frozenset({Reason.TENSOR_BUSY, Reason.SHARDS_LOST, Reason.INVALID_STATE})


@dataclass(frozen=True)
class ReshardProgress:
    """One progress report: phase ("preparing", "moving", "committing", "done"), bytes moved of the total; with
    "done", the bytes the ranks copied out of each other's memory on one host (`mapped_bytes`) and sent over
    gloo / NCCL (`sent_bytes`)."""

    phase: str
    bytes_done: int
    bytes_total: int
    version: int
    max_new_shard_bytes: int = 0
    max_staging_bytes: int = 0
    mapped_bytes: int = 0
    sent_bytes: int = 0


def reshard(
    session: Session,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Any,
    *,
    bucket_bytes: int | None = None,
    timeout: float | None = None,
    progress: Callable[[ReshardProgress], None] | None = None,
    replicas: int = 1,
) -> TensorSummary:
    """Move tensor `name` into the layout `spec` (new version), each box on `replicas` live ranks; `progress` is
    called with every report."""
    arguments.callback(progress, "progress")
    request = reshard_request(
        session,
        name,
        shape,
        dtype,
        spec,
        bucket_bytes=bucket_bytes,
        timeout=timeout,
        replicas=replicas,
    )
    messages = session.follow(
        "Reshard", request, timeout or DEFAULT_TIMEOUT_S, reporter(progress), refused=refused
    )
    return reshard_result(name, messages)


def reshard_request(
    session: Session,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Any,
    *,
    bucket_bytes: int | None = None,
    timeout: float | None = None,
    replicas: int = 1,
) -> pb.ReshardRequest:
    """The validated Reshard request moving `name` into `spec` (its layout over the live ranks, asked of the
    coordinator: a blocking call); the blocking and the asyncio clients both send it."""
    replicas = arguments.count(replicas, "replicas", minimum=1)
    if bucket_bytes is not None:
        bucket_bytes = arguments.count(bucket_bytes, "bucket_bytes", minimum=1)
    if timeout is not None:
        timeout = arguments.seconds(timeout, "timeout")
    meta = session.layouts.layout(tuple(shape), dtype, spec, replicas)
    return pb.ReshardRequest(
        name=name,
        metadata=metadata_to_proto(meta),
        bucket_bytes=bucket_bytes or 0,
        timeout_s=float(timeout or 0),
    )


def reporter(
    progress: Callable[[ReshardProgress], None] | None,
) -> Callable[[pb.ReshardProgress], None]:
    """The callback a progress stream calls with each message: `progress(ReshardProgress)`, when given."""

    def report(message: pb.ReshardProgress) -> None:
        if progress is not None:
            progress(
                ReshardProgress(
                    PHASES.get(message.phase, "unknown"),
                    message.bytes_done,
                    message.bytes_total,
                    message.version,
                    message.max_new_shard_bytes,
                    message.max_staging_bytes,
                    message.mapped_bytes,
                    message.sent_bytes,
                )
            )

    return report


def reshard_result(name: str, messages: Sequence[pb.ReshardProgress]) -> TensorSummary:
    """The new version's catalog entry from a finished progress stream's messages."""
    done = [message for message in messages if message.phase == pb.RESHARD_DONE]
    if not done:
        raise ShardServeError(f"the reshard of {name!r} ended without a result")
    return TensorSummary.from_proto(done[-1].tensor)


def refused(err: ShardServeError) -> ShardServeError:
    """`err` as a ReshardRefusedError when its reason is one a reshard is refused for."""
    if err.reason not in REFUSED_REASONS:
        return err
    return ReshardRefusedError(err.message, err.code, reason=err.reason, metadata=err.metadata)


def layout_from_options(
    shape: Sequence[int],
    dtype: Any,
    devices: dict[int, str],
    *,
    dim: int | None = None,
    ranks: Sequence[int] | None = None,
    grid: str | None = None,
    grid_dims: Sequence[int] | None = None,
    replicate: bool = False,
) -> ShardedTensorMetadata:
    """Metadata from the CLI's layout options over `devices` ({rank: device} of the live ranks)."""
    mesh_shape = check_layout_flags(dim, grid, grid_dims, replicate)
    ranks = list(ranks) if ranks else sorted(devices)
    unknown = [r for r in ranks if r not in devices]
    if unknown:
        raise InvalidArgumentError(
            f"--ranks: ranks {unknown} are not live (live: {sorted(devices)})"
        )
    if mesh_shape is not None:
        if mesh_shape[0] * mesh_shape[1] != len(ranks):
            raise InvalidArgumentError(
                f"--grid {grid} needs {mesh_shape[0] * mesh_shape[1]} ranks, "
                f"got {len(ranks)} ({ranks})"
            )
        dims = tuple(grid_dims) if grid_dims else (0, 1)
        if len(dims) != 2:
            raise InvalidArgumentError(f"--grid-dims must name two tensor dims, got {dims}")
        mesh = [ranks[i * mesh_shape[1] : (i + 1) * mesh_shape[1]] for i in range(mesh_shape[0])]
        meta = _build(
            lambda: metadata_from_placements(shape, mesh, [Shard(dims[0]), Shard(dims[1])], dtype)
        )
    elif replicate:
        meta = _build(lambda: metadata_from_placements(shape, ranks, [Replicate()], dtype))
    else:
        placements = tuple(f"rank:{r}/{devices[r]}" for r in ranks)
        return _build(
            lambda: ChunkShardingSpec(dim or 0, placements).build_metadata(  # type: ignore[arg-type]
                tuple(shape), TensorProperties(dtype=dtype)
            )
        )
    shards = tuple(
        dataclasses.replace(s, placement=f"rank:{s.rank}/{devices[s.rank]}")  # type: ignore[arg-type]
        for s in meta.shards_metadata
    )
    return dataclasses.replace(meta, shards_metadata=shards)


def check_layout_flags(
    dim: int | None, grid: str | None, grid_dims: Sequence[int] | None, replicate: bool
) -> tuple[int, int] | None:
    """The layout flags' own consistency, before any cluster is asked: one of --dim, --grid or --replicate,
    --grid-dims only with --grid, --grid as RxC; returns the grid's mesh shape (None without --grid)."""
    if sum((dim is not None, grid is not None, replicate)) > 1:
        raise InvalidArgumentError("give one of --dim, --grid or --replicate")
    if grid_dims and grid is None:
        raise InvalidArgumentError(
            "--grid-dims goes with --grid (which mesh dims shard which tensor dims)"
        )
    return _grid(grid) if grid is not None else None


def _build(make: Callable[[], ShardedTensorMetadata]) -> ShardedTensorMetadata:
    try:
        return make()
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"layout: {err}") from None


def _grid(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InvalidArgumentError(f"--grid must look like 2x2, got {text!r}")
    return int(parts[0]), int(parts[1])
