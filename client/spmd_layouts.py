"""The server layouts of a state dict's tensors, as job rank 0 records them in a new snapshot: the job's boxes
balanced by bytes over the live ranks (with replicas), or the user's spec cut by the job's boxes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardserve.client.errors import InvalidArgumentError
from shardserve.client.info import RankStatus
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.replicas import replicate_layout
from shardserve.core.snapshots import JobTensor, balanced_layouts, refine_layout


def balanced(
    session: Session, tensors: Mapping[str, JobTensor], replicas: int, ranks: Sequence[RankStatus]
) -> dict[str, ShardedTensorMetadata]:
    """Each tensor's layout: the job's boxes over the live `ranks`, balanced by bytes, with `replicas`."""
    live = [r for r in sorted(ranks, key=lambda r: r.rank) if r.alive]
    if not live:
        raise InvalidArgumentError(
            f"no live rank is registered with the coordinator at {session.address}"
        )
    layouts = balanced_layouts(tensors, [f"rank:{r.rank}/{r.device}" for r in live])
    if replicas > 1:
        candidates = session.layouts.replica_candidates()
        layouts = {
            key: replicate_layout(meta, replicas, candidates) for key, meta in layouts.items()
        }
    return layouts


def from_spec(
    session: Session, tensors: Mapping[str, JobTensor], spec: Any, replicas: int
) -> dict[str, ShardedTensorMetadata]:
    """Each tensor's layout by `spec` (one for all tensors, or {key: spec}), its shards cut by the job's boxes so
    that every job rank writes only what it holds."""
    return {
        key: refine_layout(
            session.layouts.layout(t.size, t.dtype, _spec_of(spec, key), replicas), t
        )
        for key, t in tensors.items()
    }


def _spec_of(spec: Any, key: str) -> Any:
    if isinstance(spec, Mapping):
        if key not in spec:
            raise InvalidArgumentError(
                f"spec has no entry for {key!r} (give one spec for all tensors, or one per key)"
            )
        return spec[key]
    return spec
