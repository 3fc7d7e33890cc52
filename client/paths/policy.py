"""The client's choice of data path per read, lookup or write: shared memory, the bulk TCP port, or gRPC.

transport="auto" tries, in order, what works for the rank: shared memory when
it runs on this host (client.paths.shm), the rank's bulk TCP port when the
client does not use TLS (client.paths.bulk: 2-3x faster than a gRPC call at any
size once its connection is open), else gRPC (client.paths.grpc). A failure
of a fast path is logged (WARNING, with its reason); that rank is then served
by the next path for RETRY_AFTER_S before the fast path is tried again. "grpc", "shm" and "tcp" force one path; a
forced fast path that cannot serve raises instead of falling back.

A rank that fails a call as unreachable (RankUnavailableError, on any path) is
remembered for UNREACHABLE_S: reads and lookups then choose another copy of its
boxes where the layout has one (shardcore.health.pick_copy), as they do for the
ranks the coordinator reports dead.

Every part runs as a race (client.paths.hedging): one that has not answered within the hedge delay is asked of
another copy where its box has one (the first answer wins; the rank that lost is read last, as an unreachable
one, for UNREACHABLE_S), and one with no other copy ends with RankUnavailableError once the coordinator reports
its rank dead, instead of waiting out its deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from shardserve.client.channel import Channel
from shardserve.client.errors import RankUnavailableError, ShardsLostError
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.bands import bands, read_bands
from shardserve.client.paths.bulk import BulkPath, BulkReadError
from shardserve.client.paths.grpc import GrpcPath
from shardserve.client.paths.hedging import (
    HEDGE_AFTER_S,
    Cancellation,
    Hedge,
    Landing,
    Race,
    Watchdog,
)
from shardserve.client.paths.shm import (
    SharedMemoryError,
    SharedMemoryPath,
    copy_box,
    local_host,
    same_host_reason,
)
from shardserve.client.paths.writes import ShardWrite
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSPORTS = ("auto", "grpc", "shm", "tcp")
RETRY_AFTER_S = 30.0  # a rank whose fast path failed is read by the next path this long
UNREACHABLE_S = 10.0  # a rank that failed a call as unreachable: its copies are read last this long
PIPELINED_READ_BYTES = (
    8 << 20
)  # a read of several network parts up to this size sends every request first
_FALL_BACK_WORDS = {
    "read": ("read from", "reading it"),
    "write": ("write to", "writing to it"),
}  # doing -> log


def check_transport(transport: object) -> str:
    """`transport` if it is one of TRANSPORTS, else ValueError naming the parameter."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}"
        )
    return transport  # type: ignore[return-value]


@dataclass(frozen=True)
class NetworkCall:
    """One rank's request for PathPolicy.send_all: `send_bulk(cancel)` sends it on the rank's bulk port and
    returns the call that takes its answer (None: this request may not use the port); `over_grpc(cancel)` makes
    the whole call over gRPC; `hedge` makes it of another copy (client.paths.hedging), `nbytes` its answer's
    size."""

    rank: RankStatus
    send_bulk: Callable[[Cancellation], Callable[[], object]] | None
    over_grpc: Callable[[Cancellation], object]
    hedge: Hedge | None = None
    nbytes: int = 0


class PathPolicy:
    """The data paths of one client and the choice among them per rank (transport="auto"|"grpc"|"shm"|"tcp"),
    falling back when a fast one fails."""

    def __init__(
        self, transport: str, channel: Channel | None, hedge_after: float | None = HEDGE_AFTER_S
    ) -> None:
        self.transport = check_transport(transport)
        self.channel = channel
        self.grpc = GrpcPath(channel)  # type: ignore[arg-type]
        self.bulk = BulkPath(channel)  # type: ignore[arg-type]
        self.shm = SharedMemoryPath(channel)  # type: ignore[arg-type]
        self.host = local_host()
        self._backoff: dict[
            tuple[str, str], float
        ] = {}  # (path, address) -> monotonic time it is retried
        self._unreachable: dict[
            int, float
        ] = {}  # rank -> monotonic time until which its copies are read last
        self._lock = threading.Lock()
        self._rank_check: Callable[[int], RankUnavailableError | None] = lambda rank: None
        self.watchdog = Watchdog(hedge_after, lambda rank: self._rank_check(rank))

    def watch_ranks(self, check: Callable[[int], RankUnavailableError | None]) -> None:
        """Where a part waiting on a rank asks whether it is reported dead: check(rank) -> the error to end the
        part with, or None (client.session.Session.rank_reported_dead)."""
        self._rank_check = check

    def close(self) -> None:
        """Close the kept bulk connections and forget the shared-memory mappings (unmapped once unused)."""
        self.watchdog.close()
        self.bulk.close()
        self.shm.clear()

    # ------------------------------------------------------------ reads

    def read(
        self,
        summary: TensorSummary,
        parts: Sequence[tuple[int, Box]],
        box: Box,
        out: torch.Tensor,
        rank_of: Callable[[int], RankStatus],
        copies: Callable[[int], Sequence[int]] | None = None,
    ) -> str | None:
        """Fetch each (shard index, global part) of `box` into its region of `out` (box's shape, any device), every
        part by its rank's path; returns the path of the last part (None when the box is empty). `copies(index)`
        names the other copies of a shard, the best first, that a silent part is hedged to.

        Several network parts of a small read are pipelined: every request sent first (send_all), the mapped
        parts copied meanwhile, then the answers taken."""
        if box.is_empty():
            return None
        assert self.channel is not None

        def each_by_its_path(group: Sequence[tuple[int, Box]]) -> str:
            jobs = []
            for index, part in group:
                region = local_view(out, box, part)
                jobs.append(
                    partial(
                        self.read_part,
                        rank_of(index),
                        summary,
                        index,
                        part,
                        region,
                        part == box,
                        self._read_hedge(summary, index, part, region, rank_of, copies),
                    )
                )
            return self.channel.run_all(jobs)[-1]

        mapped, networked = [], []
        for index, part in parts:
            (mapped if self.maps(rank_of(index)) else networked).append((index, part))
        if (
            len(networked) < 2
            or self.transport == "shm"
            or sum(part.numel() for _, part in networked) * out.element_size()
            > PIPELINED_READ_BYTES
        ):
            return each_by_its_path(parts)
        calls = []
        for index, part in networked:
            region = local_view(out, box, part)
            calls.append(
                self._read_call(
                    rank_of(index),
                    summary,
                    index,
                    part,
                    region,
                    self._read_hedge(summary, index, part, region, rank_of, copies),
                )
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

    def read_part(
        self,
        rank: RankStatus,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        only_part: bool = False,
        hedge: Hedge | None = None,
    ) -> str:
        """Read one part into `region` by the best path, as a race that `hedge` may win (client.paths.hedging);
        returns the path that answered ("shm", "tcp" or "grpc")."""
        race = self.watchdog.start(rank.rank, part.numel() * region.element_size(), hedge)
        try:
            path = self._read_part(rank, summary, index, part, region, only_part, race.primary)
        except BaseException as err:  # noqa: BLE001 - the hedge may answer instead; else raised again
            path, land = self.settle(race, rank, err)
            land()
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
            self.note_failure(rank, failure)
            raise
        self.note_slow(rank)
        return answered

    def _read_hedge(
        self,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        rank_of: Callable[[int], RankStatus],
        copies: Callable[[int], Sequence[int]] | None,
    ) -> Hedge | None:
        """The hedge of one part: the same part read from the best other copy into a buffer of its own, copied
        into `region` only once the race is won (the other copies are looked up only when it runs)."""
        if copies is None:
            return None

        def hedge(cancel: Cancellation) -> tuple[str, Landing]:
            others = copies(index)
            if not others:
                raise RankUnavailableError(
                    f"shard {index} of {summary.name!r} has no other copy to ask"
                )
            rank = rank_of(others[0])
            buffer = torch.empty(part.sizes, dtype=region.dtype)
            try:
                path = self._read_part(rank, summary, others[0], part, buffer, False, cancel)
            except RankUnavailableError as err:
                self.note_failure(rank, err)
                raise
            log.info(
                "read %r shard %d from rank %d (another copy) over %s: the first copy did not answer",
                summary.name,
                others[0],
                rank.rank,
                path,
            )
            return path, partial(copy_box, region, buffer)

        return hedge

    def _read_part(
        self,
        rank: RankStatus,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        only_part: bool,
        cancel: Cancellation | None = None,
    ) -> str:
        """read_part's work: shared memory when the rank may serve by it, else the network."""
        read_mapped = partial(self.shm.read, rank.address, summary, index, part, region, cancel)
        if self._through_shared_memory(rank, read_mapped)[1]:
            log.debug(
                "read %r shard %d from rank %d through shared memory",
                summary.name,
                index,
                rank.rank,
            )
            return "shm"
        path = self.over_network(
            rank,
            partial(
                self._read_over,
                rank.address,
                summary,
                index,
                part,
                region,
                only_part,
                cancel=cancel,
            ),
            cancel,
        )[1]
        log.debug("read %r shard %d from rank %d over %s", summary.name, index, rank.rank, path)
        return path

    def _read_over(
        self,
        address: str,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        only_part: bool,
        path: str,
        cancel: Cancellation | None = None,
    ) -> None:
        """One shard's part over the network (`path` "grpc" or "tcp"): straight into `region` when contiguous
        (a large part that is the read's only one as parallel row bands, client.paths.bands), else via one
        buffer."""
        read_box = self.bulk.read if path == "tcp" else self.grpc.read
        target, land = _landing(part, region)
        read_bands(
            lambda band: read_box(
                address,
                read_request(summary, index, band),
                byte_view(local_view(target, part, band)),
                cancel,
            ),
            bands(part, region.element_size()) if only_part else [part],
        )
        land()

    def _read_call(
        self,
        rank: RankStatus,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        hedge: Hedge | None = None,
    ) -> NetworkCall:
        """One shard's part of a pipelined read: its request sent on the bulk port now and its bytes taken
        into `region` later (send_all), or read over gRPC."""
        request = read_request(summary, index, part)

        def send_bulk(cancel: Cancellation) -> Callable[[], None]:
            target, land = _landing(part, region)
            answer = self.bulk.send_read(rank.address, request, byte_view(target), cancel)

            def take() -> None:
                answer()
                land()

            return take

        def over_grpc(cancel: Cancellation) -> None:
            self._read_over(rank.address, summary, index, part, region, False, "grpc", cancel)

        return NetworkCall(rank, send_bulk, over_grpc, hedge, part.numel() * region.element_size())

    # ------------------------------------------------------------ unreachable ranks

    # ------------------------------------------------------------ writes

    def write(self, rank: RankStatus, writes: Sequence[ShardWrite]) -> tuple[str, int]:
        """Write whole shards to `rank` by the fastest path that serves it: a staging memfd the rank reads on
        the same host, its bulk port, else gRPC (falling back as reads do); returns (the path, bytes written)."""
        written, staged = self._through_shared_memory(
            rank, lambda: self.shm.write_shards(rank.address, writes, self.host[1]), "write"
        )
        if staged:
            return "shm", written or 0
        written, path = self.over_network(
            rank,
            lambda path: (self.bulk if path == "tcp" else self.grpc).write_shards(
                rank.address, writes
            ),
            doing="write",
        )
        return path, written

    def note_failure(self, rank: RankStatus, err: BaseException) -> None:
        """Remember `rank` as unreachable for UNREACHABLE_S when `err` says it could not be reached."""
        if isinstance(err, RankUnavailableError) and not isinstance(err, ShardsLostError):
            with self._lock:
                self._unreachable[rank.rank] = time.monotonic() + UNREACHABLE_S
            log.info(
                "rank %d could not be reached; its copies are read last for %.0f s: %s",
                rank.rank,
                UNREACHABLE_S,
                err,
            )

    def note_slow(self, rank: RankStatus) -> None:
        """Remember `rank` as unreachable for UNREACHABLE_S: a part of it lost to a hedge (it did not answer)."""
        with self._lock:
            self._unreachable[rank.rank] = time.monotonic() + UNREACHABLE_S
        log.warning(
            "rank %d did not answer within the hedge delay and another copy did; its copies are read "
            "last for %.0f s",
            rank.rank,
            UNREACHABLE_S,
        )

    def unreachable_ranks(self) -> frozenset[int]:
        """The ranks that failed a call as unreachable in the last UNREACHABLE_S."""
        if not self._unreachable:
            return frozenset()
        now = time.monotonic()
        with self._lock:
            for rank in [r for r, until in self._unreachable.items() if until <= now]:
                del self._unreachable[rank]
            return frozenset(self._unreachable)

    # ------------------------------------------------------------ choosing

    def _through_shared_memory(
        self, rank: RankStatus, run: Callable[[], T], doing: str = "read"
    ) -> tuple[T | None, bool]:
        """(`run()`, True) when `rank` may be read through shared memory and `run` serves; (None, False) when it
        may not or `run` fails with transport="auto" (logged, and `rank` skips shared memory for a while)."""
        if not self._shm_usable(rank):
            return None, False
        try:
            return run(), True
        except SharedMemoryError as err:
            if self.transport == "shm":
                raise
            self._fall_back("shm", rank, err, doing)
            return None, False

    def over_network(
        self,
        rank: RankStatus,
        run: Callable[[str], T],
        cancel: Cancellation | None = None,
        doing: str = "read",
    ) -> tuple[T, str]:
        """`run("tcp")` when the bulk port may serve `rank`, falling back to `run("grpc")` when it fails (unless
        forced, or cancelled); returns run's result and the path that gave it."""
        if self._tcp_usable(rank):
            try:
                return run("tcp"), "tcp"
            except BulkReadError as err:
                if self.transport == "tcp" or (cancel is not None and cancel.cancelled):
                    raise
                self._fall_back("tcp", rank, err, doing)
        return run("grpc"), "grpc"

    def send_all(
        self, calls: Sequence[NetworkCall], submit: Callable[[Callable[[], object]], Future]
    ) -> SentCalls:
        """Start every call: its request out on the bulk port where that may serve the rank, else a gRPC call on
        `submit`'s threads; SentCalls.wait() takes the answers (falling back as over_network does).

        Every bulk request goes out before any answer is awaited, and all on this thread: the ranks work at
        once with no thread hand-off (one per rank cost a two-rank 512-id lookup ~250 us of client CPU), and a
        caller can hold a lock for its CPU work while sending and release it to wait. Nothing here waits on
        the network but the sends themselves and, where a rank has no kept connection, opening one (an
        OpenBulkSession call and a connect); a lone gRPC call runs in wait(), on the waiting thread."""
        usable = [
            call.send_bulk is not None and self._tcp_usable(call.rank) for call in calls
        ]  # before any send
        sent = SentCalls(self, calls, paths=["grpc"] * len(calls))
        sent.races = [
            self.watchdog.start(call.rank.rank, call.nbytes, call.hedge) for call in calls
        ]
        for index, call in enumerate(calls):
            if usable[index]:
                try:
                    sent.answers[index] = call.send_bulk(sent.races[index].primary)  # type: ignore[misc]
                    sent.paths[index] = "tcp"
                except BulkReadError as err:
                    if sent.races[index].primary.cancelled:
                        sent.failed(index, err)
                    else:
                        sent.paths[index] = self.bulk_failed(call.rank, err, sent.errors)
                except BaseException as err:  # noqa: BLE001 - raised by wait(), once the calls sent have ended
                    sent.failed(index, err)
        over_grpc = [index for index, path in enumerate(sent.paths) if path == "grpc"]
        sent.inline = over_grpc[:1] if not sent.answers else []
        sent.future_calls = over_grpc[len(sent.inline) :]
        sent.futures = [
            submit(partial(calls[index].over_grpc, sent.races[index].primary))
            for index in sent.future_calls
        ]
        return sent

    def bulk_failed(self, rank: RankStatus, err: BulkReadError, errors: list[BaseException]) -> str:
        """The path a call goes on after its bulk port failed: "grpc" (logged, the rank backs off), or "" with
        the error kept when tcp is forced."""
        if self.transport == "tcp":
            errors.append(err)
            return ""
        self._fall_back("tcp", rank, err)
        return "grpc"

    def lookup_rows(
        self, rank: RankStatus, summary: TensorSummary, index: int, ids: torch.Tensor
    ) -> torch.Tensor | None:
        """Rows `ids` (global row ids inside shard `index`) of a 2-D table through shared memory, as a CPU tensor
        [len(ids), shard columns]; None when the lookup should go over the network (same rules and fallback as
        reads)."""

        def read_rows() -> torch.Tensor:
            first_row = summary.metadata.shards_metadata[index].shard_offsets[0]
            return self.shm.read_rows(rank.address, summary, index, ids - first_row)

        try:
            rows, mapped = self._through_shared_memory(rank, read_rows)
        except RankUnavailableError as err:
            self.note_failure(rank, err)
            raise
        if not mapped:
            return None
        log.debug(
            "looked up %d rows of %r shard %d on rank %d through shared memory",
            ids.numel(),
            summary.name,
            index,
            rank.rank,
        )
        return rows

    def maps(self, rank: RankStatus) -> bool:
        """Whether reads of `rank` go through shared memory now (no error, no log: a planning question)."""
        return self.transport in ("auto", "shm") and not self._unmapped_reason(rank)

    def _backing_off(self, path: str, rank: RankStatus) -> bool:
        with self._lock:
            return self._backoff.get((path, rank.address), 0.0) > time.monotonic()

    def _unmapped_reason(self, rank: RankStatus) -> str:
        """Why `rank` is not read through shared memory now (not on this host, or backing off after a failure
        with transport="auto"), or "" when it is."""
        reason = same_host_reason(rank, self.host)
        if not reason and self.transport == "auto" and self._backing_off("shm", rank):
            reason = "an earlier shared-memory read of this rank failed"
        return reason

    def _shm_usable(self, rank: RankStatus) -> bool:
        """Whether `rank` may be tried through shared memory now (raises for transport="shm" when impossible)."""
        if self.transport not in ("auto", "shm"):
            return False
        reason = self._unmapped_reason(rank)
        if reason and self.transport == "shm":
            raise SharedMemoryError(f"transport='shm' is impossible: {reason}")
        if reason:
            log.debug("rank %d not through shared memory: %s", rank.rank, reason)
        return not reason

    def _tcp_usable(self, rank: RankStatus) -> bool:
        """Whether `rank` may be tried over its bulk port now (TLS or not, as its gRPC port)."""
        if self.transport == "tcp":
            return True
        return self.transport == "auto" and not self._backing_off("tcp", rank)

    def _fall_back(self, path: str, rank: RankStatus, err: Exception, doing: str = "read") -> None:
        """Move `rank`'s bytes (reads and writes) by the next path for RETRY_AFTER_S, logging why."""
        with self._lock:
            self._backoff[(path, rank.address)] = time.monotonic() + RETRY_AFTER_S
        what = "shared-memory" if path == "shm" else "bulk TCP"
        instead = "over gRPC" if path == "tcp" else "over the bulk port or gRPC"
        failed, again = _FALL_BACK_WORDS[doing]
        log.warning(
            "%s %s rank %d failed; %s %s for %.0f s: %s",
            what,
            failed,
            rank.rank,
            again,
            instead,
            RETRY_AFTER_S,
            err,
        )


@dataclass
class SentCalls:
    """Calls started by PathPolicy.send_all; wait() ends them."""

    policy: PathPolicy
    calls: Sequence[NetworkCall]
    paths: list[str]  # per call: "tcp", "grpc", or "" (failed before any answer)
    answers: dict[int, Callable[[], object]] = field(
        default_factory=dict
    )  # bulk answers to take, by call
    errors: list[BaseException] = field(default_factory=list)
    inline: list[int] = field(default_factory=list)  # calls to make over gRPC on the waiting thread
    futures: list[Future] = field(default_factory=list)
    future_calls: list[int] = field(default_factory=list)  # per future, the call it makes
    races: list[Race] = field(default_factory=list)  # per call (client.paths.hedging)

    def wait(self) -> list[str]:
        """Take every bulk answer (a failed one falls back to gRPC here), wait for the gRPC calls; returns each
        call's path and raises the first failure once every call has ended. A call whose hedge answered
        first takes the hedge's answer here, once its own call has returned."""
        try:
            self._take_answers()
        finally:
            for race in self.races:
                self.policy.watchdog.finish(race)
        if self.errors:
            raise self.errors[0]
        return self.paths

    def _take_answers(self) -> None:
        for index, answer in self.answers.items():
            try:
                answer()
            except BulkReadError as err:
                if self.races[index].primary.cancelled:
                    self.failed(index, err)
                    continue
                self.paths[index] = self.policy.bulk_failed(
                    self.calls[index].rank, err, self.errors
                )
                if self.paths[index] == "grpc":
                    self.inline.append(index)
            except BaseException as err:  # noqa: BLE001 - raised by wait(), after every call ended
                self.failed(index, err)
            else:
                self.races[index].primary_done()
        runs = [
            *(
                (index, partial(self.calls[index].over_grpc, self.races[index].primary))
                for index in self.inline
            ),
            *((index, future.result) for index, future in zip(self.future_calls, self.futures)),
        ]
        for index, run in runs:
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - raised by wait(), after every call ended
                self.failed(index, err)
            else:
                self.races[index].primary_done()

    def cancel(self) -> None:
        """Cancel every call (a hedge whose primary answered first drops its calls)."""
        for race in self.races:
            race.primary.cancel()

    def failed(self, index: int, err: BaseException) -> None:
        """Call `index` failed with `err`: its hedge's answer lands when it has one, else the error is kept."""
        try:
            path, land = self.policy.settle(self.races[index], self.calls[index].rank, err)
            land()
        except BaseException as failure:  # noqa: BLE001 - raised by wait(), after every call ended
            self.errors.append(failure)
            self.paths[index] = ""
            return
        self.paths[index] = path


def read_request(summary: TensorSummary, index: int, box: Box) -> pb.ReadRegionRequest:
    """The ReadRegionRequest of global `box` inside shard `index` at the summary's version."""
    return pb.ReadRegionRequest(
        name=summary.name,
        version=summary.version,
        shard_index=index,
        offsets=box.offsets,
        sizes=box.sizes,
    )


def _landing(part: Box, region: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """Where a part's bytes land (`region` itself when contiguous on the CPU, else a buffer of its own: pinned
    for a CUDA region, one DMA up) and the call that moves them into `region` once they arrived."""
    if region.is_contiguous() and region.device.type == "cpu":
        return region, lambda: None
    on_gpu = region.device.type == "cuda"
    target = torch.empty(part.sizes, dtype=region.dtype, pin_memory=on_gpu)
    return target, lambda: region.copy_(target, non_blocking=on_gpu)
