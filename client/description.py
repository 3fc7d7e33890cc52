"""TensorDescription: what a tensor proxy answers from its cached summary alone, like torch.Tensor's metadata
(shape, dtype, numel ...) and ShardedTensor's layout (metadata, sharding_spec), without a call."""

from __future__ import annotations

import torch

from shardserve.client.info import TensorSummary
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec


class TensorDescription:
    """Name, version, shape, dtype and layout of a tensor at its cached summary (`_summary`)."""

    def __init__(self, summary: TensorSummary) -> None:
        self._summary = summary

    @property
    def summary(self) -> TensorSummary:
        """The catalog entry this proxy is cached at."""
        return self._summary

    @property
    def name(self) -> str:
        return self._summary.name

    @property
    def version(self) -> int:
        return self._summary.version

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._summary.metadata.size)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """Like torch.Tensor.size()."""
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._summary.metadata.dtype

    @property
    def ndim(self) -> int:
        return self._summary.metadata.ndim

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self._summary.metadata.numel()

    @property
    def nbytes(self) -> int:
        return self._summary.metadata.nbytes

    @property
    def replicas(self) -> int:
        """The number of copies of each box (the minimum over boxes; 1 for a layout without replicas)."""
        return self._summary.layout_health.replicas

    def metadata(self) -> ShardedTensorMetadata:
        """The shardcore ShardedTensorMetadata of the cached version."""
        return self._summary.metadata

    def sharding_spec(self) -> ChunkShardingSpec | EnumerableShardingSpec:
        """A spec that builds this layout: a ChunkShardingSpec when one does, else an EnumerableShardingSpec."""
        meta = self.metadata()
        placements = tuple(s.placement for s in meta.shards_metadata)
        for dim in range(meta.ndim):
            spec = ChunkShardingSpec(dim, placements)  # type: ignore[arg-type]
            if spec.build_metadata(meta.size, meta.tensor_properties) == meta:
                return spec
        return EnumerableShardingSpec(meta.shards_metadata)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"version={self.version}, shards={len(self._summary.metadata.shards_metadata)})"
        )

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]
