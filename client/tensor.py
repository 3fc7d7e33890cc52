"""RemoteShardedTensor: a ShardedTensor-like proxy of a tensor held by the cluster's ranks.

It caches the tensor's metadata at one version. A read asks every shard it
touches in parallel (client.paths.policy picks each rank's path), each part
landing in a preallocated output; when a rank no longer serves that version,
the proxy refreshes its metadata and retries the whole read, so a result never
mixes two versions. Each box is read from a live copy (shardcore.health): a
rank that cannot be reached makes the retry use another copy, and a box with
no live copy left raises ShardsLostError (client.health).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardserve.client import counters
from shardserve.client.embedding.lookup import Lookups
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.health import check_readable
from shardserve.client.indexing import parse_index
from shardserve.client.info import RankStatus, RepairProgress, TensorSummary
from shardserve.client.ops.reshard import reshard as reshard_tensor
from shardserve.client.ops.row_updates import update_rows
from shardserve.client.retry import read_with_refresh
from shardserve.client.session import Session
from shardserve.core.metadata import Box, ShardedTensorMetadata, ShardMetadata
from shardserve.core.regions import check_box, shards_for_box
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec


@dataclass(frozen=True)
class RemoteShard:
    """One shard of a remote tensor at one version: its metadata and a way to fetch it."""

    tensor: RemoteShardedTensor = field(repr=False)
    index: int
    summary: TensorSummary = field(repr=False)

    @property
    def metadata(self) -> ShardMetadata:
        return self.summary.metadata.shards_metadata[self.index]

    @property
    def version(self) -> int:
        return self.summary.version

    @property
    def rank(self) -> int:
        return self.metadata.rank

    def __repr__(self) -> str:
        return (
            f"RemoteShard(name={self.summary.name!r}, version={self.version}, index={self.index}, "
            f"offsets={self.metadata.shard_offsets}, sizes={self.metadata.shard_sizes}, "
            f"placement='{self.metadata.placement}')"
        )

    def fetch(self) -> torch.Tensor:
        """The whole shard, read from its own rank (raises StaleVersionError once the version is gone)."""
        box = self.metadata.box
        out = torch.empty(box.sizes, dtype=self.summary.metadata.dtype)
        self.tensor._read_parts(self.summary, [(self.index, box)], box, out)
        return out


class RemoteShardedTensor:
    """A sharded tensor held by the cluster, read by offset, slice or whole."""

    def __init__(self, session: Session, lookups: Lookups, summary: TensorSummary) -> None:
        self._session = session
        self._lookups = lookups
        self._summary = summary
        self.last_transport: str | None = (
            None  # "shm", "tcp" or "grpc": the path of the latest part read
        )

    # ------------------------------------------------------------ description

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

    def metadata(self) -> ShardedTensorMetadata:
        """The shardcore ShardedTensorMetadata of the cached version."""
        return self._summary.metadata

    def sharding_spec(self) -> ChunkShardingSpec | EnumerableShardingSpec:
        """A spec that builds this layout: a ChunkShardingSpec when one does, else an EnumerableShardingSpec."""
        meta = self.metadata()
        placements = [s.placement for s in meta.shards_metadata]
        for dim in range(meta.ndim):
            spec = ChunkShardingSpec(dim, placements)
            if spec.build_metadata(meta.size, meta.tensor_properties) == meta:
                return spec
        return EnumerableShardingSpec(meta.shards_metadata)

    # ------------------------------------------------------------ health (shardcore.health)

    @property
    def health(self) -> str:
        """ "healthy", "degraded" (some box has fewer live copies than replicas) or "lost" (some box has no live
        copy), as the coordinator says now (asks it: the proxy then follows the latest version)."""
        return self.refresh()._summary.health

    @property
    def lost_boxes(self) -> list[Box]:
        """The boxes with no live copy (reads touching them raise ShardsLostError), as the coordinator says now."""
        return list(self.refresh()._summary.layout_health.lost_boxes)

    @property
    def repair(self) -> RepairProgress | None:
        """The coordinator's repair of this tensor in flight (version made, bytes copied, ranks receiving), or
        None, as the coordinator says now."""
        return self.refresh()._summary.repair

    @property
    def replicas(self) -> int:
        """The number of copies of each box (the minimum over boxes; 1 for a layout without replicas)."""
        return self._summary.layout_health.replicas

    def remote_shards(self) -> dict[int, list[RemoteShard]]:
        """{rank: [RemoteShard]} of the cached version, like ShardedTensor.remote_shards without RRefs."""
        summary = self._summary
        shards: dict[int, list[RemoteShard]] = {}
        for index, shard in enumerate(summary.metadata.shards_metadata):
            shards.setdefault(shard.rank, []).append(RemoteShard(self, index, summary))
        return shards

    def refresh(self) -> RemoteShardedTensor:
        """Reload the metadata (a newer version if the tensor was overwritten); returns self."""
        self._summary = self._session.summary(self.name)
        return self

    def reshard(
        self,
        spec: Any,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
        progress: Any = None,
        replicas: int = 1,
    ) -> RemoteShardedTensor:
        """Move the tensor into layout `spec` (any spec `put` takes, over any ranks): a proxy of the new version.

        Two-phase on the cluster (see client.ops.reshard): reads keep the old version until the new one is
        committed; `timeout` bounds the data movement, `progress(ReshardProgress)` sees bytes moved;
        `replicas` > 1 holds every box of `spec` on that many live ranks (shardcore.replicas).
        """
        summary = reshard_tensor(
            self._session,
            self.name,
            tuple(self.shape),
            self.dtype,
            spec,
            bucket_bytes,
            timeout,
            progress,
            replicas,
        )
        return RemoteShardedTensor(self._session, self._lookups, summary)

    # ------------------------------------------------------------ embedding lookups (client.embedding.lookup)

    def lookup(self, ids: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of this 2-D table for `ids` (1-D ints), like F.embedding: Tensor[len(ids), dim]."""
        return self._lookups.lookup({self.name: ids}, dtype)[self.name]

    def lookup_bag(
        self,
        ids: Any,
        offsets: Any,
        mode: str = "mean",
        per_sample_weights: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> torch.Tensor:
        """Pooled bags like F.embedding_bag(ids, table, offsets, mode=..., per_sample_weights=...)."""
        return self._lookups.lookup_bag(
            self.name, ids, offsets, mode, per_sample_weights, dtype, pooling
        )

    def update_rows(self, ids: Any, values: torch.Tensor) -> int:
        """Replace rows in a new version, atomically; the proxy then follows it. Returns the new version."""
        version = update_rows(self._session, self._lookups.views, self.name, ids, values)
        self.refresh()
        return version

    def __repr__(self) -> str:
        return (
            f"RemoteShardedTensor(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"version={self.version}, shards={len(self._summary.metadata.shards_metadata)})"
        )

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ------------------------------------------------------------ reads

    def fetch(
        self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The global box at `offsets` of `sizes`, into `out` (any strides, any device) or a new tensor."""
        try:
            box = Box(tuple(offsets), tuple(sizes))
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"offsets/sizes: {err}") from None
        return self._read(lambda shape: box, out)

    def read_plan(self, box: Box, out: torch.Tensor) -> tuple[TensorSummary, list[tuple[int, Box]]]:
        """The summary and the (shard index, global part) of each shard that a fetch of `box` into `out` would read,
        a live copy chosen as fetch chooses it; raises as fetch does for a bad box or `out` (callers that read
        the parts themselves, like batched small reads)."""
        self._session.check_open()
        summary = self._summary
        self._check_request(summary, box, out)
        unavailable = self._session.unavailable_shards(summary)
        check_readable(summary, box, unavailable)
        return summary, shards_for_box(
            summary.metadata,
            box,
            unavailable=unavailable,
            suspect=self._session.suspect_shards(summary),
        )

    def __getitem__(self, index: Any) -> torch.Tensor:
        """`t[i, a:b, ...]` with ints and step-1 slices (negative ones too); ints drop their dim like torch."""
        parsed: list[tuple[Box, tuple[int, ...]]] = []

        def resolve(shape: tuple[int, ...]) -> Box:  # re-resolved if a refresh changed the shape
            parsed.append(parse_index(index, shape))
            return parsed[-1][0]

        result = self._read(resolve, None)
        box, dropped = parsed[-1]
        if dropped:
            result = result.reshape([n for d, n in enumerate(box.sizes) if d not in dropped])
        return result

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor as one local CPU tensor."""
        return self._read(lambda shape: Box((0,) * len(shape), shape), None)

    def _check_request(self, summary: TensorSummary, box: Box, out: torch.Tensor | None) -> None:
        """InvalidArgumentError unless `box` lies inside the tensor and `out` fits it."""
        try:
            check_box(summary.metadata.size, box)
        except ValueError as err:
            raise InvalidArgumentError(
                f"{err} (tensor {self.name!r} has shape {summary.metadata.size})"
            ) from None
        if out is None:
            return
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != box.sizes:
            raise InvalidArgumentError(
                f"out has shape {tuple(out.shape)} but sizes are {box.sizes}"
            )
        if out.dtype != summary.metadata.dtype:
            raise InvalidArgumentError(
                f"out has dtype {out.dtype} but tensor {self.name!r} is {summary.metadata.dtype}"
            )
        problem = _unwritable(out)
        if problem:
            raise InvalidArgumentError(f"out {problem}; pass a plain dense tensor to read into")

    def _read(
        self, resolve: Callable[[tuple[int, ...]], Box], out: torch.Tensor | None
    ) -> torch.Tensor:
        """Read the box `resolve(shape)` at the cached version; if that version is gone, refresh and
        retry the whole read (the box is resolved again against the new shape)."""
        self._session.check_open()
        if (
            self._session.newest_seen(self.name) > self._summary.version
        ):  # replaced, yet served in its grace
            self.refresh()
        return read_with_refresh(
            lambda: self._read_once(resolve, out),
            self._refresh_for_retry,
            self._session.channel.timeout,
        )

    def _refresh_for_retry(self) -> int:
        self._session.refresh_ranks()
        return self.refresh().version

    def _read_once(
        self, resolve: Callable[[tuple[int, ...]], Box], out: torch.Tensor | None
    ) -> torch.Tensor:
        summary = self._summary
        box = resolve(summary.metadata.size)
        self._check_request(summary, box, out)
        unavailable = self._session.unavailable_shards(summary)
        check_readable(summary, box, unavailable)
        target = out if out is not None else torch.empty(box.sizes, dtype=summary.metadata.dtype)
        parts = shards_for_box(
            summary.metadata,
            box,
            unavailable=unavailable,
            suspect=self._session.suspect_shards(summary),
        )
        self._read_parts(summary, parts, box, target)
        if target.device.type == "cuda":
            torch.cuda.synchronize(
                target.device
            )  # the parts' copies (made on pool threads' streams) are done
        return target

    def _read_parts(
        self, summary: TensorSummary, parts: Sequence[tuple[int, Box]], box: Box, out: torch.Tensor
    ) -> None:
        """Fetch each (shard index, global part) of `box` into its region of `out`, by the paths client.paths
        picks per rank."""

        def rank_of(index: int) -> RankStatus:
            return self._session.rank_status(summary.metadata.shards_metadata[index].rank)

        path = self._session.paths.read(
            summary,
            parts,
            box,
            out,
            rank_of,
            lambda index: self._session.other_copies(summary, index),
        )
        if path is not None:
            self.last_transport = path
            counters.count_read(path, box.numel() * out.element_size())


def _unwritable(out: torch.Tensor) -> str:
    """Why the read's bytes cannot be copied into `out` in place ("" when they can)."""
    if out.device.type == "meta":
        return "is on the meta device (it holds no data)"
    if out.layout != torch.strided:
        return f"has layout {out.layout}"
    if out.requires_grad:
        return "requires grad (autograd refuses in-place writes into it)"
    if out.is_conj() or out.is_neg():
        return "is a lazily conjugated or negated view"
    if out.is_inference() and not torch.is_inference_mode_enabled():
        return "was made in inference mode"
    if torch._debug_has_internal_overlap(out) == 1:
        return "has elements that share memory (a zero stride, as from expand)"
    return ""
