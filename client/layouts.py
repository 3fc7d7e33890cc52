"""Layouts of new tensors: a spec (ours, torch's, or metadata) over the live ranks, with replicas.

The default spec is row-wise over every live rank (a 0-d tensor whole on the first live rank); `replicas` > 1
holds every box on that many live ranks (shardcore.replicas), ranks asked of the coordinator now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.client.info import RankStatus
from shardserve.client.ranks import RECENT_RANKS_S, RankDirectory
from shardserve.core.interop import as_spec
from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.replicas import CandidateRank, replicate_layout
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.core.validation import validate_metadata


class Layouts:
    """Lays new tensors out over the ranks of `ranks` (asked of the coordinator for every layout)."""

    def __init__(self, ranks: RankDirectory) -> None:
        self.ranks = ranks

    def layout(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        spec: Any,
        replicas: int = 1,
        *,
        recent: bool = False,
    ) -> ShardedTensorMetadata:
        """The layout of a tensor of `shape`/`dtype` under `spec` (default: row-wise over every live rank; a 0-d
        tensor whole on the first live rank), with every box on `replicas` live ranks (shardcore.replicas).
        `recent`: the ranks as listed at most RECENT_RANKS_S ago (a steady put's), else listed now."""
        replicas = arguments.count(replicas, "replicas", minimum=1)
        meta = self._spec_layout(shape, dtype, spec, recent)
        if replicas == 1:
            return meta
        try:
            return replicate_layout(meta, replicas, self.replica_candidates(recent=recent))
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None

    def replica_candidates(self, *, recent: bool = False) -> list[CandidateRank]:
        """The live ranks as candidates for copies (listed now, or at most RECENT_RANKS_S ago when `recent`):
        host by host_id (the hostname where a rank reports none), device as registered."""
        return [
            CandidateRank(r.rank, r.host_id or r.hostname, r.device)
            for r in sorted(self._listed(recent), key=lambda r: r.rank)
            if r.alive
        ]

    def _listed(self, recent: bool) -> list[RankStatus]:
        return self.ranks.recent(RECENT_RANKS_S) if recent else self.ranks.refresh()

    def _spec_layout(
        self, shape: Sequence[int], dtype: torch.dtype, spec: Any, recent: bool
    ) -> ShardedTensorMetadata:
        """The layout `spec` gives a tensor of `shape`/`dtype`, validated."""
        if spec is None:
            spec = self._default_spec(shape, recent)
        spec = _resolve_spec(spec)
        try:
            if isinstance(spec, ShardedTensorMetadata):
                meta = spec
                if meta.size != tuple(shape) or meta.dtype != dtype:
                    raise ValueError(
                        f"spec metadata is for a {meta.dtype} tensor of size {meta.size}, "
                        f"not {dtype} of size {tuple(shape)}"
                    )
            else:
                meta = spec.build_metadata(tuple(shape), TensorProperties(dtype=dtype))
            validate_metadata(meta)
        except ValueError as err:
            raise InvalidArgumentError(f"spec: {err}") from None
        return meta

    def _default_spec(
        self, shape: Sequence[int], recent: bool
    ) -> ChunkShardingSpec | EnumerableShardingSpec:
        live = [r for r in sorted(self._listed(recent), key=lambda r: r.rank) if r.alive]
        if not live:
            raise RankUnavailableError(
                f"no live rank is registered with the coordinator at {self.ranks.where}"
            )
        placements = tuple(f"rank:{r.rank}/{r.device}" for r in live)
        if not len(shape):
            return EnumerableShardingSpec((ShardMetadata((), (), placements[0]),))  # type: ignore[arg-type]
        return ChunkShardingSpec(0, placements)  # type: ignore[arg-type]


def _resolve_spec(spec: Any) -> Any:
    """A shardcore spec from ours or torch's ChunkShardingSpec / EnumerableShardingSpec (metadata passes as is)."""
    if isinstance(spec, ShardedTensorMetadata):
        return spec
    try:
        return as_spec(spec)
    except TypeError as err:
        raise TypeError(f"spec: {err}") from None
    except ValueError as err:
        raise InvalidArgumentError(f"spec: {err}") from None
