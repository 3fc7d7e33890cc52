"""Session: what the client's helpers share of one connection, instead of reaching into Cluster.

Coordinator calls (unary and progress streams), the ranks' addresses and
status, tensor summaries and layouts, the put lifecycle (create, commit,
abort), and the data paths; Cluster, the tensor proxies, the embedding
lookups and the operations in client.ops all work through it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch

from shardserve.client import arguments
from shardserve.client.channel import Channel
from shardserve.client.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RankUnavailableError,
    ShardServeError,
    error_from_rpc,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.hedging import other_copies
from shardserve.client.paths.policy import PathPolicy
from shardserve.client.paths.writes import ShardWrite, write_shards
from shardserve.core.interop import as_spec
from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.replicas import CandidateRank, replicate_layout
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.core.validation import validate_metadata
from shardserve.protos import shardserve_pb2 as pb

T = TypeVar("T")
_STREAM_SLACK_S = 60.0  # a progress stream's deadline beyond the bound of the work it follows
RANKS_MAX_AGE_S = 1.0  # a waiting read's liveness checks share one ListRanks answer this long


class Session:
    """One client's connection: the coordinator at `address`, the ranks it lists, and the data paths to them."""

    def __init__(self, address: str, channel: Channel, paths: PathPolicy) -> None:
        self.address = address
        self.channel = channel
        self.paths = paths
        self._coordinator = channel.coordinator(address)
        self._ranks: dict[int, RankStatus] = {}
        self._ranks_lock = threading.Lock()
        self._ranks_at = 0.0  # time.monotonic() of the latest ListRanks answer
        self._ranks_at = 0.0  # monotonic time of the latest ListRanks answer
        self._liveness_lock = threading.Lock()
        self._seen: dict[str, int] = {}  # name -> the newest committed version this client saw
        self._seen_guard = threading.Lock()
        paths.watch_ranks(self.rank_reported_dead)

    def close(self) -> None:
        """Close every bulk connection, shared-memory mapping (unmapped once no tensor uses it) and channel."""
        self.paths.close()
        self.channel.close()

    def check_open(self) -> None:
        """ShardServeError once close() ran."""
        self.channel.check_open()

    def run_all(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """Run `jobs` on the client's pool (the first on this thread); raise the first failure once all ended."""
        return self.channel.run_all(jobs)

    def write_shards(self, writes: Sequence[tuple[int, ShardWrite]]) -> dict[str, int]:
        """Write whole shards of pending versions, (rank, write) each, every rank by its fastest path and all
        ranks at once; returns the bytes written per path (client.paths.writes)."""
        return write_shards(self.paths.write, self.rank_status, writes, self.run_all)

    # ------------------------------------------------------------ coordinator calls

    def call(self, method: str, request: Any) -> Any:
        """The coordinator's unary `method` with deadline and auth; errors as ShardServeErrors."""
        return self.channel.unary(
            getattr(self._coordinator, method), request, f"coordinator at {self.address}"
        )

    def follow(
        self,
        method: str,
        request: Any,
        work_timeout: float,
        report: Callable[[Any], None],
        refused: Callable[[ShardServeError], ShardServeError] | None = None,
    ) -> list[Any]:
        """The coordinator's progress stream `method`: report(message) for every message, in order; returns them.

        The stream's deadline is `work_timeout` plus slack for the coordinator's own steps; an error is raised
        as `refused(error)` returns it, when given. The call is cancelled however it ends (Ctrl-C in `report` too),
        which aborts the work on the coordinator."""
        self.check_open()
        call = getattr(self._coordinator, method)(
            request, timeout=work_timeout + _STREAM_SLACK_S, metadata=self.channel.metadata
        )
        messages = []
        try:
            for message in call:
                messages.append(message)
                report(message)
        except grpc.RpcError as err:
            error = error_from_rpc(err, f"coordinator at {self.address}")
            raise (refused(error) if refused is not None else error) from None
        finally:
            call.cancel()
        return messages

    # ------------------------------------------------------------ ranks

    def refresh_ranks(self) -> list[RankStatus]:
        """Every registered rank, fetched from the coordinator now (and kept for rank_status)."""
        ranks = [
            RankStatus.from_proto(r) for r in self.call("ListRanks", pb.ListRanksRequest()).ranks
        ]
        with self._ranks_lock:
            self._ranks = {r.rank: r for r in ranks}
            self._ranks_at = time.monotonic()
            self._ranks_at = time.monotonic()
        return ranks

    def rank_reported_dead(self, rank: int) -> RankUnavailableError | None:
        """The error to end a read waiting on `rank` with when the coordinator reports it dead, else None.

        Asks ListRanks at most once per RANKS_MAX_AGE_S, however many reads wait: one asks, the others
        use its answer."""
        with self._liveness_lock:
            if time.monotonic() - self._ranks_at >= RANKS_MAX_AGE_S:
                self.refresh_ranks()
        status = self._ranks.get(rank)
        if status is None or status.alive:
            return None
        return RankUnavailableError(
            f"rank {rank} at {status.address} did not answer and the coordinator at "
            f"{self.address} reports it dead",
            grpc.StatusCode.UNAVAILABLE,
        )

    def known_ranks(self) -> list[int]:
        """The ranks seen at the latest refresh, sorted (no call)."""
        return sorted(self._ranks)

    def rank_status(self, rank: int) -> RankStatus:
        """The registered status of `rank` (address, host, shared memory), refreshed once if unknown."""
        status = self._ranks.get(rank)
        if status is None or not status.address:
            status = {r.rank: r for r in self.refresh_ranks()}.get(rank)
        if status is None or not status.address:
            raise RankUnavailableError(
                f"rank {rank} is not registered with the coordinator at {self.address}"
            )
        return status

    def address_of(self, rank: int) -> str:
        return self.rank_status(rank).address

    def dead_ranks(self) -> frozenset[int]:
        """The ranks the coordinator reported dead at the latest refresh (no call)."""
        with self._ranks_lock:
            return frozenset(rank for rank, status in self._ranks.items() if not status.alive)

    def unavailable_shards(self, summary: TensorSummary) -> frozenset[int]:
        """The shards of `summary` with no readable copy as the coordinator says: lost, or on a rank reported
        dead (in the summary's answer, or at a ListRanks answered after it: a newer answer wins)."""
        with self._ranks_lock:
            if self._ranks_at <= summary.answered_at:
                return summary.unavailable
        dead = self.dead_ranks()
        if not dead:
            return summary.unavailable
        shards = summary.metadata.shards_metadata
        return summary.unavailable | {
            i for i, shard in enumerate(shards) if shard.placement and shard.rank in dead
        }

    def suspect_shards(self, summary: TensorSummary) -> frozenset[int]:
        """The shards of `summary` on ranks that failed this client's calls as unreachable lately (their copies are
        read last: client.paths.policy)."""
        unreachable = self.paths.unreachable_ranks()
        if not unreachable:
            return frozenset()
        return frozenset(
            i
            for i, shard in enumerate(summary.metadata.shards_metadata)
            if shard.placement and shard.rank in unreachable
        )

    def other_copies(self, summary: TensorSummary, index: int) -> list[int]:
        """The other readable copies of shard `index` of `summary` on other ranks, the best first (for a
        hedge: client.paths.hedging)."""
        return other_copies(
            summary.metadata, index, self.unavailable_shards(summary), self.suspect_shards(summary)
        )

    # ------------------------------------------------------------ tensors

    def summary(self, name: str) -> TensorSummary:
        """The catalog entry of the READY tensor `name` (TensorNotFoundError if there is none)."""
        info = self.call("GetTensor", pb.GetTensorRequest(name=arguments.tensor_name(name)))
        self.saw_version(info.name, info.version)
        return TensorSummary.from_proto(info)

    def saw_version(self, name: str, version: int) -> None:
        """Remember the newest version of `name` this client has seen committed (its own writes included)."""
        with self._seen_guard:
            if version > self._seen.get(name, 0):
                self._seen[name] = version

    def newest_seen(self, name: str) -> int:
        """The newest version of `name` this client saw committed (0: none): a proxy cached at an older one
        reads the newer one instead, although ranks keep serving the older one for their grace period."""
        return self._seen.get(name, 0)

    def layout(
        self, shape: Sequence[int], dtype: torch.dtype, spec: Any, replicas: int = 1
    ) -> ShardedTensorMetadata:
        """The layout of a tensor of `shape`/`dtype` under `spec` (default: row-wise over every live rank; a 0-d
        tensor whole on the first live rank), with every box on `replicas` live ranks (shardcore.replicas)."""
        replicas = arguments.count(replicas, "replicas", minimum=1)
        meta = self._spec_layout(shape, dtype, spec)
        if replicas == 1:
            return meta
        try:
            return replicate_layout(meta, replicas, self.replica_candidates())
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None

    def replica_candidates(self) -> list[CandidateRank]:
        """The live ranks as candidates for copies, fetched now: host by host_id (the hostname where a rank
        reports none), device as registered."""
        return [
            CandidateRank(r.rank, r.host_id or r.hostname, r.device)
            for r in sorted(self.refresh_ranks(), key=lambda r: r.rank)
            if r.alive
        ]

    def _spec_layout(
        self, shape: Sequence[int], dtype: torch.dtype, spec: Any
    ) -> ShardedTensorMetadata:
        """The layout `spec` gives a tensor of `shape`/`dtype`, validated."""
        if spec is None:
            spec = self._default_spec(shape)
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

    def _default_spec(self, shape: Sequence[int]) -> ChunkShardingSpec | EnumerableShardingSpec:
        live = [r for r in sorted(self.refresh_ranks(), key=lambda r: r.rank) if r.alive]
        if not live:
            raise RankUnavailableError(
                f"no live rank is registered with the coordinator at {self.address}"
            )
        placements = [f"rank:{r.rank}/{r.device}" for r in live]
        return (
            ChunkShardingSpec(0, placements)
            if len(shape)
            else EnumerableShardingSpec([ShardMetadata((), (), placements[0])])
        )

    def create_tensor(self, request: pb.CreateTensorRequest) -> pb.TensorInfo:
        """CreateTensor under a fresh put token. When the answer is lost (deadline, connection) the version may
        have been made anyway, with no one to write or abort it: the token aborts it (or, if the coordinator
        has not run the call yet, makes it refuse the call), instead of leaving it to the pending timeout."""
        request.put_token = uuid.uuid4().hex
        try:
            return self.call("CreateTensor", request)
        except (DeadlineExceededError, RankUnavailableError):
            with contextlib.suppress(ShardServeError):
                self.call(
                    "AbortTensor",
                    pb.AbortTensorRequest(name=request.name, put_token=request.put_token),
                )
            raise

    def commit(self, name: str, version: int) -> pb.TensorInfo:
        """CommitTensor of a pending version. When the answer is lost (deadline, connection) the commit may still
        have happened: then the READY version says so, and it counts as done rather than being reported failed
        while it is visible."""
        try:
            committed = self.call(
                "CommitTensor", pb.CommitTensorRequest(name=name, version=version)
            )
            self.saw_version(name, committed.version)
            return committed
        except (DeadlineExceededError, RankUnavailableError):
            try:
                ready = self.call("GetTensor", pb.GetTensorRequest(name=name))
            except ShardServeError:
                ready = None
            if ready is not None and ready.version == version:
                return ready
            raise

    def abort(self, name: str, version: int) -> None:
        """Best-effort AbortTensor of a pending version (the coordinator also times pending ones out)."""
        with contextlib.suppress(ShardServeError):
            self.call("AbortTensor", pb.AbortTensorRequest(name=name, version=version))


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
