"""Calls from the coordinator to its ranks: fanned out in parallel, with a deadline, naming the rank that failed.

Every lifecycle call to ranks goes through `RankCalls` (allocate, promote, drop, what a rank holds), so liveness
checks, error naming and quiet drops are written once for the lifecycle, the snapshots and the reshard and
checkpoint drivers. The records they name become the ranks' request messages here.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import Message

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import RankUnavailable, ServiceError, relayed
from shardserve.server.coordinator.catalog.documents import LAYOUTS_CACHED
from shardserve.server.coordinator.catalog.messages import init_to_proto, options_to_proto
from shardserve.server.coordinator.catalog.records import Init, ShardChecksums, TensorRecord
from shardserve.server.coordinator.ranks.call_loop import CallLoop
from shardserve.server.coordinator.ranks.call_threads import CallThreads
from shardserve.server.coordinator.ranks.encoded import Encoded, Entries, serialized
from shardserve.server.coordinator.ranks.messages import held_from_proto, served_from_proto
from shardserve.server.coordinator.ranks.registry import RankEntry, RankRegistry

log = logging.getLogger(__name__)


class Holdings(NamedTuple):
    """The (name, version) pairs a rank holds, and those of them it serves."""

    held: set[tuple[str, int]]
    served: frozenset[tuple[str, int]]


@dataclass(frozen=True)
class Promoted:
    """What the ranks answered a promote, both by (name, version) then shard index: each shard's checksum, and
    the bytes each shard of a copy (a row update's, a delta put's) still shares with other versions."""

    answers: tuple[pb.PromoteManyResponse, ...]
    shared: dict[tuple[str, int], dict[int, int]]

    @functools.cached_property
    def checksums(self) -> ShardChecksums:
        """Each shard's checksum, decoded on first use: a commit records them, a rank's reconcile (which
        promotes again the versions the rank holds unserved) never reads them."""
        return checksums_of(self.answers)


@dataclass(frozen=True)
class Allocation:
    """How ranks allocate a new version: filled by `init` (seeded by `seed`; a copy of `source_version`), or
    only its memory reserved (`reserve_only`: a job writes it)."""

    init: Init = Init.NONE
    seed: int = 0
    source_version: int = 0
    reserve_only: bool = False
    source_name: str = ""  # Init.COPY of another tensor than the allocated one ("": the same)


_NO_ANSWER = object()  # a rank's outcome when its call did not end in time

# a fan-out to at most this many ranks runs its calls as blocking calls on kept threads; a larger one on grpc.aio
CALL_THREADS = 32


class RankCalls:
    """Calls to registered ranks, each with a deadline of `rpc_timeout` seconds. A fan-out issues every rank's call
    at once, then waits for them all: its time is that of the slowest rank, whatever the number of ranks. A few
    calls run as blocking calls on kept threads (server/coordinator/ranks/call_threads.py: the quickest for the
    one or two ranks of most puts); many, and any that find no kept thread free, run on the call loop's grpc.aio
    channels (server/coordinator/ranks/call_loop.py: the cheapest per call for a thousand). No pool bounds how
    many are in flight."""

    def __init__(
        self, registry: RankRegistry, rpc_timeout: float = 60.0, *, threads: int = CALL_THREADS
    ) -> None:
        self.registry = registry
        self.rpc_timeout = rpc_timeout
        self._threads = CallThreads(threads)
        self._loop = CallLoop(registry.security)

    def close(self) -> None:
        """End the kept call threads once their calls return, and the call loop (its calls cancelled)."""
        self._threads.close()
        self._loop.close()

    def fan_out(
        self, ranks: Iterable[int], method: str, request: Message, what: str
    ) -> dict[int, Any]:
        """Call `method` with the same `request` on every rank at once; raise the first failure as a
        ServiceError naming the rank."""
        return self.fan_out_each(method, {rank: request for rank in ranks}, what)

    def fan_out_each(
        self, method: str, requests: Mapping[int, Message | Encoded], what: str
    ) -> dict[int, Any]:
        """Call `method` on each rank with its own request, all at once; raise the first failure as a
        ServiceError naming the rank. A rank that is not alive fails at once (a stopped rank would hold the
        call until its deadline)."""
        registry = self.registry
        entries = {rank: registry.entry(rank) for rank in requests}
        failures: list[ServiceError] = []
        live: dict[int, RankEntry] = {}
        for rank, entry in entries.items():
            if registry.is_alive(entry):  # judged once: a rank is either called or failed
                live[rank] = entry
            else:
                registry.note_missed(rank)
                failures.append(RankUnavailable(f"rank {rank} ({entry.info.address}) is not alive"))
        outcomes = self._outcomes(method, {rank: requests[rank] for rank in live}, live)
        results: dict[int, Any] = {}
        for rank, entry in live.items():
            outcome = outcomes.get(rank, _NO_ANSWER)
            if isinstance(outcome, grpc.RpcError):
                registry.note_missed(rank)
                failures.append(_rank_error(rank, entry.info.address, outcome))
            elif outcome is _NO_ANSWER:
                registry.note_missed(rank)
                failures.append(
                    RankUnavailable(
                        f"rank {rank} ({entry.info.address}) did not answer "
                        f"within {self.rpc_timeout:.0f}s"
                    )
                )
            elif isinstance(outcome, Exception):
                raise outcome
            else:
                results[rank] = outcome
        if failures:
            log.warning("%s failed: %s", what, "; ".join(f.message for f in failures))
            raise failures[0]
        return results

    def _outcomes(
        self, method: str, requests: Mapping[int, Message], entries: Mapping[int, RankEntry]
    ) -> dict[int, Any]:
        """Each rank's answer, or the exception its call failed with; a rank is missing when its call had not
        ended a few seconds past its deadline. The calls run on kept threads while the fan-out is small and one
        is free, else (every call of a large fan-out) on the call loop."""
        deadline = time.monotonic() + self.rpc_timeout + 5.0  # the calls carry their own too
        kept: dict[int, futures.Future[Any]] = {}
        if len(requests) <= self._threads.size:
            for rank, request in requests.items():
                call = self._threads.start(
                    partial(getattr(entries[rank].stub, method), request, timeout=self.rpc_timeout)
                )
                if call is not None:
                    kept[rank] = call
        rest = {
            rank: (entries[rank].info.address, request)
            for rank, request in requests.items()
            if rank not in kept
        }
        looped = self._loop.call_all(method, rest, timeout=self.rpc_timeout) if rest else None
        outcomes: dict[int, Any] = {}
        for rank, call in kept.items():
            try:
                outcomes[rank] = call.result(timeout=max(0.0, deadline - time.monotonic()))
            except futures.TimeoutError:
                call.cancel()
            except Exception as err:  # noqa: BLE001 - the rank's outcome, judged by the caller
                outcomes[rank] = err
        if looped is not None:
            outcomes.update(looped.wait(max(0.0, deadline - time.monotonic())))
        return outcomes

    def allocate(
        self, ranks: Iterable[int], record: TensorRecord, allocation: Allocation, what: str
    ) -> None:
        """AllocateShards of `record` on `ranks` at once; the first failure raised, naming the rank."""
        self.fan_out(ranks, "AllocateShards", allocation_request(record, allocation), what)

    def allocate_many(
        self,
        records: Mapping[int, list[TensorRecord]],
        what: str,
        *,
        writer_host_id: str = "",
        dropping: Mapping[int, list[tuple[str, int]]] | None = None,
        copies: Mapping[str, tuple[str, int]] | None = None,
    ) -> list[pb.WritableShard]:
        """AllocateMany of each rank's records (filled by their writers), one call per rank, ranks at once; the
        first failure raised. With `writer_host_id`, the shards each rank opened for that same-host writer.
        `dropping`: versions each rank drops first, in the same call (another rank's are dropped quietly).
        `copies`: {name: (source name, source version)} of records allocated as copies sharing the source's
        blocks (a delta put's)."""
        dropping, copies = dropping or {}, copies or {}
        allocations: Entries[TensorRecord] = Entries(
            pb.AllocateManyRequest,
            "tensors",
            lambda r: allocation_entry(r, _allocation_for(copies.get(r.name))),
        )
        drops: Entries[tuple[str, int]] = Entries(
            pb.AllocateManyRequest, "drop_first", serialized(_drop_request)
        )
        fields = pb.AllocateManyRequest(writer_host_id=writer_host_id).SerializeToString()
        requests = {
            rank: Encoded(
                fields + allocations.joined(mine, key=id) + drops.joined(dropping.get(rank, ()))
            )
            for rank, mine in records.items()
        }
        elsewhere = {rank: v for rank, v in dropping.items() if rank not in requests}
        if elsewhere:
            self.drop_many_quietly(elsewhere)
        answers = self.fan_out_each("AllocateMany", requests, what)
        return [shard for answer in answers.values() for shard in answer.writable]

    def promote(self, ranks: Iterable[int], name: str, version: int, what: str) -> dict[int, int]:
        """PromoteVersion of (name, version) on `ranks` at once; the first failure raised, naming the rank.
        Returns the checksum of each shard the ranks hold, by shard index."""
        request = pb.PromoteVersionRequest(name=name, version=version)
        answers = self.fan_out(ranks, "PromoteVersion", request, what)
        return checksums_of(answers.values()).get((name, version), {})

    def promote_many(
        self,
        versions: Mapping[int, list[tuple[str, int]]],
        what: str,
        *,
        finish_in_place: bool = False,
    ) -> Promoted:
        """PromoteMany of each rank's (name, version) pairs, one call per rank, ranks at once; with
        `finish_in_place`, the shards their writers filled in place count as written first. Returns the
        checksums of the shards the ranks hold, and the bytes the shards of copies still share."""
        entries = Entries(pb.PromoteManyRequest, "versions", serialized(_promote_request))
        fields = pb.PromoteManyRequest(finish_in_place=finish_in_place).SerializeToString()
        requests = {rank: Encoded(fields + entries.joined(mine)) for rank, mine in versions.items()}
        answers = list(self.fan_out_each("PromoteMany", requests, what).values())
        shared: dict[tuple[str, int], dict[int, int]] = {}
        for answer in answers:
            _by_shard(answer.shared, "nbytes", shared)
        return Promoted(tuple(answers), shared)

    def drop_many_quietly(self, versions: Mapping[int, list[tuple[str, int]]]) -> None:
        """DropMany on the live ranks, logging (not raising) failures, as drop_quietly does for one version."""
        entries = Entries(pb.DropManyRequest, "versions", serialized(_drop_request))
        requests = {
            rank: Encoded(entries.joined(mine))
            for rank, mine in versions.items()
            if self._reachable(rank)
        }
        count = sum(len(mine) for rank, mine in versions.items() if rank in requests)
        try:
            self.fan_out_each("DropMany", requests, f"drop {count} versions")
        except ServiceError as err:
            log.warning("could not drop every version everywhere: %s", err.message)

    def drop_quietly(self, name: str, version: int, ranks: Iterable[int]) -> None:
        """DropVersion on the live ones of `ranks` in parallel, logging (not raising) failures: the catalog is
        already right, and a rank that is down drops the version when it registers again (reconcile)."""
        request = pb.DropVersionRequest(name=name, version=version)
        live = [r for r in ranks if self._reachable(r)]
        try:
            self.fan_out(live, "DropVersion", request, f"drop {name!r} version {version}")
        except ServiceError as err:
            log.warning("could not drop %r version %d everywhere: %s", name, version, err.message)

    def _reachable(self, rank: int) -> bool:
        """Whether `rank` is alive; a call skipped because it is not is noted (the rank is reconciled when it
        comes back)."""
        if self.registry.rank_alive(rank):
            return True
        self.registry.note_missed(rank)
        return False

    def held_by(self, rank: int) -> Holdings | None:
        """What `rank` holds now (GetStats); None, logged, when it cannot tell."""
        try:
            stub = self.registry.entry(rank).stub
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=self.rpc_timeout)
        except (grpc.RpcError, ServiceError) as err:
            log.warning("could not ask rank %d what it holds: %s", rank, err)
            return None
        return Holdings(set(held_from_proto(stats.held)), served_from_proto(stats.held))


def allocation_request(record: TensorRecord, allocation: Allocation) -> pb.AllocateShardsRequest:
    """The AllocateShardsRequest that allocates `record` on its ranks as `allocation` says."""
    return pb.AllocateShardsRequest(
        name=record.name,
        version=record.version,
        metadata=metadata_to_proto(record.metadata),
        init=init_to_proto(allocation.init),
        seed=allocation.seed,
        options=options_to_proto(record.options),
        source_version=allocation.source_version,
        reserve_only=allocation.reserve_only,
        source_name=allocation.source_name,
    )


def allocation_entry(record: TensorRecord, allocation: Allocation) -> bytes:
    """The AllocateShardsRequest of `record` serialized: its name and version (and the tensor it copies), then
    the fields it shares with every record of its layout, options and kind of allocation, encoded once (a
    message's encoding followed by another's parses as their merge). Encoding a 10-shard layout for each of
    10,000 tensors took most of a snapshot's allocation requests; a delta put's copies each name another source."""
    own = pb.AllocateShardsRequest(
        name=record.name,
        version=record.version,
        source_version=allocation.source_version,
        source_name=allocation.source_name,
    ).SerializeToString()
    kind = (
        replace(allocation, source_version=0, source_name="")
        if allocation.source_version or allocation.source_name
        else allocation
    )
    return own + _shared_allocation_fields(record.metadata, record.options, kind)


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _shared_allocation_fields(
    metadata: ShardedTensorMetadata, options: TensorOptions, allocation: Allocation
) -> bytes:
    """The fields of an AllocateShardsRequest besides the name and version, serialized."""
    return allocation_request(
        TensorRecord("", 0, metadata, options=options), allocation
    ).SerializeToString()


def _promote_request(version: tuple[str, int]) -> pb.PromoteVersionRequest:
    return pb.PromoteVersionRequest(name=version[0], version=version[1])


def _drop_request(version: tuple[str, int]) -> pb.DropVersionRequest:
    return pb.DropVersionRequest(name=version[0], version=version[1])


def _allocation_for(source: tuple[str, int] | None) -> Allocation:
    """How a snapshot's tensor is allocated: left for its writer to fill, or a copy of `source`."""
    if source is None:
        return Allocation()
    return Allocation(init=Init.COPY, source_version=source[1], source_name=source[0])


def versions_by_rank(
    records: Iterable[TensorRecord], ranks: Callable[[TensorRecord], Iterable[int]]
) -> dict[int, list[tuple[str, int]]]:
    """{rank: [(name, version), ...]} of `records`, each under every rank `ranks(record)` names."""
    out: dict[int, list[tuple[str, int]]] = {}
    for record in records:
        for rank in ranks(record):
            out.setdefault(rank, []).append((record.name, record.version))
    return out


def checksums_of(
    answers: Iterable[pb.PromoteVersionResponse | pb.PromoteManyResponse],
) -> ShardChecksums:
    """The shard checksums of promote answers, by (name, version) then shard index."""
    out: ShardChecksums = {}
    for answer in answers:
        _by_shard(answer.checksums, "checksum", out)
    return out


def _by_shard(
    items: Iterable[pb.ShardChecksum | pb.SharedShardBytes],
    field: str,
    out: dict[tuple[str, int], dict[int, int]],
) -> dict[tuple[str, int], dict[int, int]]:
    """`out` with the number `field` of each per-shard item of a promote answer (a checksum, shared bytes) added,
    by (name, version) then shard index. A rank's items of one version come one after another: the version's
    entry is looked up once per run of them (a 100,000-shard commit's answers carry 100,000 items)."""
    key: tuple[str, int] | None = None
    shards: dict[int, int] = {}
    value = operator.attrgetter(field)
    for item in items:
        name, version = item.name, item.version
        if key is None or key[1] != version or key[0] != name:
            key = (name, version)
            shards = out.setdefault(key, {})
        shards[item.shard_index] = value(item)
    return out


def _rank_error(rank: int, address: str, err: grpc.RpcError) -> ServiceError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return RankUnavailable(
            f"rank {rank} ({address}) is unavailable: {details}", metadata={"rank": rank}
        )
    return relayed(err, f"rank {rank}: {details}", metadata={"rank": rank})
