"""The client's choice of data path per read, lookup or write: shared memory, the bulk TCP port, or gRPC.

The policy holds the paths client.paths.factory builds and asks each for what it needs by the capabilities it
declares (client.paths.kinds): the first path of a rank's chain that maps memory, reads rows or writes in
place; the paths that take rank calls, pipelined or streamed. It never names a concrete path.

transport="auto" reads through an ordered fallback chain (client.paths.chain) of what may serve the rank:
shared memory when it runs on this host (client.paths.shm), the rank's bulk TCP port (client.paths.bulk: 2-3x
faster than a gRPC call at any size once its connection is open; a TLS mismatch falls back), else gRPC
(client.paths.grpc). A fast path that fails with PATH_UNAVAILABLE is logged (WARNING, with its reason); that
rank is then served by the next path for RETRY_AFTER_S (a lease in client.health) before the fast path is
tried again. "grpc", "shm" and "bulk" force one path (parsed into a PathKind at connect()); a forced fast path
that cannot serve raises instead of falling back. Network-only calls (pooled lookups, ReadRegions batches) take
the network part of the chain (the paths that take rank calls: the bulk port, then gRPC), or the streamed path
(gRPC) where the forced one takes none.

A rank that fails a call as unreachable (RankUnavailableError, on any path) is read last for a while
(client.health.RankHealth): reads and lookups then choose another copy of its boxes where the layout has one,
as they do for the ranks the coordinator reports dead.

Every part runs as a race (client.paths.hedging): one that has not answered within the hedge delay is asked of
another copy where its box has one (the first answer wins; the rank that lost is read last for a while), and
one with no other copy ends with RankUnavailableError once the coordinator reports its rank dead, instead of
waiting out its deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

import torch

from shardserve.client.channel import Channel
from shardserve.client.errors import RankUnavailableError, ShardServeError
from shardserve.client.health import RankHealth
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.chain import FallbackChain
from shardserve.client.paths.copies import copy_tensor
from shardserve.client.paths.factory import data_paths
from shardserve.client.paths.hedging import (
    HEDGE_AFTER_S,
    Cancellation,
    Hedge,
    Landing,
    Race,
    Watchdog,
)
from shardserve.client.paths.kinds import (
    DataPath,
    PartRead,
    PathKind,
    PipelinedCalls,
    RowReads,
    StreamedCalls,
    in_place_writes,
    path_refused,
    pipelined,
    row_reads,
    streamed,
)
from shardserve.client.paths.network import landing, read_request
from shardserve.client.paths.pipeline import CallPipeline, NetworkCall, SentCalls
from shardserve.client.paths.writes import ShardWrite
from shardserve.client.ranks import RankDirectory
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)

PIPELINED_READ_BYTES = (
    8 << 20
)  # a read of several network parts up to this size sends every request first

RankOf = Callable[[int], RankStatus]  # shard index -> the status of the rank holding it
CopiesOf = Callable[[int], Sequence[int]]  # shard index -> its other copies, the best first


class PathPolicy:
    """The data paths of one client and the chains that choose among them per rank (`forced`: the PathKind of
    transport="grpc"|"shm"|"bulk", None for "auto"), with the races that hedge their calls. `paths`: the data
    paths, the fastest first (default: client.paths.factory's)."""

    def __init__(
        self,
        forced: PathKind | None,
        channel: Channel | None,
        *,
        health: RankHealth | None = None,
        hedge_after: float | None = HEDGE_AFTER_S,
        paths: Sequence[DataPath] | None = None,
    ) -> None:
        self.forced = forced
        self.channel = channel
        self.health = health or RankHealth(RankDirectory(list, "no coordinator"))
        self.paths = tuple(data_paths(channel) if paths is None else paths)
        self.direct = self._streamed_path()
        self.reads, self.network = self._chains(forced)
        self.watchdog = Watchdog(hedge_after, self.health.rank_reported_dead)
        self.pipeline = CallPipeline(self.network, self.direct, self.watchdog, self.settle)

    def path(self, kind: PathKind) -> DataPath:
        """The path a user names by `kind` (transport=...); KeyError when this client has none of that kind."""
        for path in self.paths:
            if path.kind is kind:
                return path
        raise KeyError(f"this client has no {kind} path")

    def _streamed_path(self) -> StreamedCalls:
        """The path whole calls are made on where no pipelined one serves: the first declaring streamed calls."""
        for path in self.paths:
            found = streamed(path)
            if found is not None:
                return found
        raise ValueError("a client needs a data path that declares streamed rank calls")

    def _chains(self, forced: PathKind | None) -> tuple[FallbackChain, FallbackChain]:
        """(the chain of reads and writes, the chain of network-only calls) for `forced`: the network chain is
        the reads chain's paths that take rank calls, else (a forced path that takes none) the streamed path."""
        if forced is None:
            reads = FallbackChain(self.paths, self.health)
        else:
            reads = FallbackChain([self.path(forced)], self.health, forced=True)
        calls = [path for path in reads.paths if path.capabilities.rank_calls]
        if len(calls) == len(reads.paths):
            return reads, reads
        return reads, FallbackChain(calls or [self.direct], self.health)

    def close(self) -> None:
        """Close every path: kept connections closed, mappings forgotten (unmapped once unused)."""
        self.watchdog.close()
        for path in self.paths:
            path.close()

    # ------------------------------------------------------------ reads

    def read(
        self,
        summary: TensorSummary,
        parts: Sequence[tuple[int, Box]],
        box: Box,
        out: torch.Tensor,
        *,
        rank_of: RankOf,
        copies: CopiesOf | None = None,
        checksums: dict[int, int] | None = None,
    ) -> PathKind | None:
        """Fetch each (shard index, global part) of `box` into its region of `out` (box's shape, any device), every
        part by its rank's path; returns the path of the last part (None when the box is empty). `copies(index)`
        names the other copies of a shard, the best first, that a silent part is hedged to. `checksums`: where
        paths that hash as they copy keep the checksums of the whole shards that landed (PartRead.checksums).

        Several network parts of a small read are pipelined: every request sent first (send_all), the mapped
        parts (and those no path serves, which fail as the chain says) copied meanwhile, then the answers
        taken."""
        if box.is_empty():
            return None
        assert self.channel is not None

        def part_read(index: int, part: Box) -> PartRead:
            return PartRead(
                summary, index, part, local_view(out, box, part), part == box, checksums
            )

        def each_by_its_path(group: Sequence[tuple[int, Box]]) -> PathKind:
            jobs = []
            for index, part in group:
                read = part_read(index, part)
                hedge = self._read_hedge(read, rank_of, copies)
                jobs.append(partial(self.read_part, rank_of(index), read, hedge))
            return self.channel.run_all(jobs)[-1]  # type: ignore[union-attr]

        mapped: list[tuple[int, Box]] = []
        networked: list[tuple[int, Box]] = []
        for index, part in parts:
            first = self.reads.first(rank_of(index))
            if first is None or first.capabilities.maps_memory:
                mapped.append(
                    (index, part)
                )  # copied here, or refused by read_part as the chain says
            else:
                networked.append((index, part))
        network_bytes = (
            sum(part.numel() for _, part in networked) * summary.metadata.tensor_properties.itemsize
        )
        if len(networked) < 2 or network_bytes > PIPELINED_READ_BYTES:
            return each_by_its_path(parts)
        calls = []
        for index, part in networked:
            read = part_read(index, part)
            calls.append(
                self._read_call(rank_of(index), read, self._read_hedge(read, rank_of, copies))
            )
        sent = self.send_all(calls, self.channel.submit)
        try:
            if mapped:
                each_by_its_path(mapped)
        finally:
            paths = sent.wait()
        log.debug(
            "read %r shards %s over %s", summary.name, [index for index, _ in networked], paths
        )
        return paths[-1]

    def read_part(self, rank: RankStatus, read: PartRead, hedge: Hedge | None = None) -> PathKind:
        """Read one part into its region by the best path, as a race that `hedge` may win
        (client.paths.hedging); returns the path that answered."""
        race = self.watchdog.start(rank.rank, read.nbytes, hedge)
        try:
            path = self._read_part(rank, read, race.primary)
        except BaseException as err:  # noqa: BLE001 - the hedge may answer instead; else raised again
            answered, land = self.settle(race, rank, err)
            land()
            path = PathKind(answered)
        else:
            race.primary_done()
        finally:
            self.watchdog.finish(race)
        return path

    def settle(self, race: Race, rank: RankStatus, err: BaseException) -> tuple[str, Landing]:
        """After the primary call of `race` to `rank` failed with `err`: the hedge's (path, landing) when it
        answered (`rank` is then read last for a while), else the failure raised (and remembered)."""
        try:
            answered = race.primary_failed(err)
        except BaseException as failure:
            self.health.note_failure(rank.rank, failure)
            raise
        self.health.note_slow(rank.rank)
        return answered

    def _read_hedge(self, read: PartRead, rank_of: RankOf, copies: CopiesOf | None) -> Hedge | None:
        """The hedge of one part: the same part read from the best other copy into a buffer of its own, copied
        into its region only once the race is won (the other copies are looked up only when it runs)."""
        if copies is None:
            return None

        def hedge(cancel: Cancellation) -> tuple[str, Landing]:
            others = copies(read.index)
            if not others:
                raise RankUnavailableError(
                    f"shard {read.index} of {read.summary.name!r} has no other copy to ask"
                )
            rank = rank_of(others[0])
            buffer = torch.empty(read.part.sizes, dtype=read.region.dtype)
            try:
                path = self._read_part(
                    rank, PartRead(read.summary, others[0], read.part, buffer), cancel
                )
            except RankUnavailableError as err:
                self.health.note_failure(rank.rank, err)
                raise
            log.info(
                "read %r shard %d from rank %d (another copy) over %s: the first copy did not answer",
                read.summary.name,
                others[0],
                rank.rank,
                path,
            )
            return path.value, partial(copy_tensor, read.region, buffer)

        return hedge

    def _read_part(
        self, rank: RankStatus, read: PartRead, cancel: Cancellation | None = None
    ) -> PathKind:
        """read_part's work: the first path of the read chain that serves."""
        _, path = self.reads.run(
            rank, lambda data_path: data_path.read(rank.address, read, cancel), cancel=cancel
        )
        how = (
            "through shared memory" if self.path(path).capabilities.maps_memory else f"over {path}"
        )
        log.debug("read %r shard %d from rank %d %s", read.summary.name, read.index, rank.rank, how)
        return path

    def _read_call(self, rank: RankStatus, read: PartRead, hedge: Hedge | None) -> NetworkCall:
        """One shard's part of a pipelined read: its request sent on a pipelined path now and its bytes taken
        into its region later (send_all), or read whole on the streamed path."""
        request = read_request(read.summary, read.index, read.part)

        def send(path: PipelinedCalls, cancel: Cancellation) -> Callable[[], None]:
            target, land = landing(read.part, read.region, read.summary.metadata.dtype)
            answer = path.send_read(rank.address, request, byte_view(target), cancel)

            def take() -> None:
                answer()
                land()

            return take

        def call(path: StreamedCalls, cancel: Cancellation) -> None:
            path.read(rank.address, read, cancel)

        return NetworkCall(rank, send, call, hedge, read.nbytes)

    # ------------------------------------------------------------ writes, lookups

    def in_place_host(self) -> str:
        """The host id under which ranks may open shards for this client's in-place writes at allocation
        (CreateSnapshot's writer_host_id): that of the first path of the read chain that writes in place, ""
        when none does (a forced transport that leaves out shared memory)."""
        for path in self.reads.paths:
            writer = in_place_writes(path)
            if writer is not None:
                return writer.in_place_host_id
        return ""

    def write(self, rank: RankStatus, writes: Sequence[ShardWrite]) -> tuple[PathKind, int]:
        """Write whole shards to `rank` by the fastest path that serves it: in place or through a staging memfd
        on the same host, its bulk port, else gRPC (falling back as reads do); returns (the path, bytes
        written)."""
        written, path = self.reads.run(
            rank, lambda data_path: data_path.write_shards(rank.address, writes), doing="write"
        )
        return path, written

    def write_bytes_in_memory(
        self, rank: RankStatus, request: pb.WriteBytesRequest, pieces: Sequence[torch.Tensor]
    ) -> int | None:
        """WriteBytes of `request`'s ranges (their bytes: `pieces`, flat uint8 CPU tensors) through memory the
        rank reads, by the first path of the chain that writes in place and may serve `rank`; the bytes written,
        or None when no such path serves it or the rank refuses (the caller sends the bytes in the request)."""
        for path in self.reads.paths:
            writer = in_place_writes(path)
            if writer is None or not path.supports(rank):
                continue
            try:
                return writer.write_bytes(rank.address, request, pieces)
            except ShardServeError as err:
                if not path_refused(err):
                    raise
                log.debug("byte ranges to %s through memory: %s; sending them", rank.address, err)
            return None
        return None

    def sends_now(self, rank: RankStatus) -> bool:
        """Whether a call to `rank` goes out on a pipelined path (send_all sends it at once, without a thread)."""
        return pipelined(self.network.first(rank)) is not None

    def send_all(
        self, calls: Sequence[NetworkCall], submit: Callable[[Callable[[], object]], Future]
    ) -> SentCalls:
        """Start every call, the pipelined requests all sent before any answer is awaited
        (client.paths.pipeline)."""
        return self.pipeline.send_all(calls, submit)

    def lookup_rows(
        self, rank: RankStatus, summary: TensorSummary, index: int, ids: torch.Tensor
    ) -> torch.Tensor | None:
        """Rows `ids` (global row ids inside shard `index`) of a 2-D table read by the path `rank` is read by
        first, where that path reads rows (shared memory), as a CPU tensor [len(ids), shard columns]; None when
        the lookup should go over the network (same rules and fallback as reads)."""
        paths = self.reads.paths_for(rank)
        reader = row_reads(paths[0]) if paths else None
        if reader is None:
            return None
        first_row = summary.metadata.shards_metadata[index].shard_offsets[0]
        try:
            rows = reader.read_rows(rank.address, summary, index, ids - first_row)
        except RankUnavailableError as err:
            self.health.note_failure(rank.rank, err)
            raise
        except ShardServeError as err:
            if self.reads.falls_back(reader, rank, err):
                return None
            raise
        log.debug(
            "looked up %d rows of %r shard %d on rank %d over %s",
            ids.numel(),
            summary.name,
            index,
            rank.rank,
            reader.kind,
        )
        return rows

    def row_reader(self, rank: RankStatus) -> RowReads | None:
        """The path reads of `rank` go through first now where it reads rows in place (its mappings), else
        None (no error, no log: a planning question)."""
        return row_reads(self.reads.first(rank))

    def maps(self, rank: RankStatus) -> bool:
        """Whether reads of `rank` go through mapped memory now (no error, no log: a planning question)."""
        first = self.reads.first(rank)
        return first is not None and first.capabilities.maps_memory

    def mapped_devices(self, rank: RankStatus) -> frozenset[str]:
        """The device types whose shards reads of `rank` map now (empty when its first path maps none)."""
        first = self.reads.first(rank)
        if first is None or not first.capabilities.maps_memory:
            return frozenset()
        return first.capabilities.devices
