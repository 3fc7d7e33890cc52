"""Session: what the client's helpers share of one connection, instead of reaching into Cluster.

The coordinator's calls (unary and progress streams) and the put lifecycle (create, commit, abort) are
Session's own; it holds the collaborators the proxies, the embedding lookups and the operations in client.ops
share: the ranks' directory (client.ranks), their health leases (client.health), the data paths
(client.paths.policy), the layouts of new tensors (client.layouts) and the versions this client has seen.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from shardserve.client import catalog_requests as catalog
from shardserve.client.channel import Channel
from shardserve.client.coordinators import Coordinators
from shardserve.client.errors import (
    DeadlineExceededError,
    RankUnavailableError,
    ShardServeError,
)
from shardserve.client.health import RankHealth
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.layouts import Layouts
from shardserve.client.new_tensor import NewTensor
from shardserve.client.paths.hedging import HEDGE_AFTER_S
from shardserve.client.paths.kinds import PathKind
from shardserve.client.paths.policy import PathPolicy
from shardserve.client.paths.writes import ShardWrite, write_shards
from shardserve.client.ranks import RECENT_RANKS_S, RankDirectory
from shardserve.client.reservations import Reservations
from shardserve.client.tensor_reservations import TensorReservations
from shardserve.core.delta import split_pieces
from shardserve.core.wire import metadata_to_proto, options_to_proto
from shardserve.protos import shardserve_pb2 as pb

T = TypeVar("T")
INLINE_BYTES_PER_CALL = 4 << 20  # WriteBytes' bytes per request where they travel inline
# how long close() gives each abort of a snapshot or version reserved for a next put
RELEASE_TIMEOUT_S = 2.0
READ_THREADS = (
    8  # tensors of a snapshot or state dict read at once (each read fans out on the channel's pool)
)


class SeenVersions:
    """The newest committed version of each tensor this client has seen (its own writes included)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def saw(self, name: str, version: int) -> None:
        with self._lock:
            if version > self._seen.get(name, 0):
                self._seen[name] = version

    def newest(self, name: str) -> int:
        """The newest version of `name` seen committed (0: none)."""
        return self._seen.get(name, 0)


class Session:
    """One client's connection: the coordinators at `address` ("HOST:PORT", or several "A,B" of which one
    leads: client/coordinators.py), and the ranks, health leases and data paths (`forced`: the PathKind of a
    forced transport, None for "auto") its helpers share."""

    def __init__(
        self,
        address: str,
        channel: Channel,
        *,
        forced: PathKind | None = None,
        hedge_after: float | None = HEDGE_AFTER_S,
    ) -> None:
        self.address = address
        self.channel = channel
        self.coordinators = Coordinators(address, channel)
        self.ranks = RankDirectory(self._list_ranks, address)
        self.health = RankHealth(self.ranks)
        self.paths = PathPolicy(forced, channel, health=self.health, hedge_after=hedge_after)
        self.layouts = Layouts(self.ranks)
        self.versions = SeenVersions()
        self.reservations = Reservations()
        self.tensor_reservations = TensorReservations()
        # reads of many tensors at once: a pool of its own, since each read waits on the channel's pool
        self.read_pool = ThreadPoolExecutor(
            max_workers=READ_THREADS, thread_name_prefix="shardserve-read"
        )

    def close(self) -> None:
        """Abort the snapshots and tensor versions reserved for this client's next puts (their memory is freed
        now, not at the pending timeout), then close every bulk connection, shared-memory mapping (unmapped once
        no tensor uses it) and channel."""
        self.reservations.release_all(
            lambda prefix, number: self._release(
                "AbortSnapshot", pb.AbortSnapshotRequest(prefix=prefix, number=number)
            )
        )
        self.tensor_reservations.release_all(
            lambda name, version: self._release(
                "AbortTensor", pb.AbortTensorRequest(name=name, version=version)
            )
        )
        self.read_pool.shutdown(wait=False, cancel_futures=True)
        self.paths.close()
        self.channel.close()

    def _release(self, method: str, request: Any) -> None:
        """Abort a reservation at close, within RELEASE_TIMEOUT_S (else the pending timeout frees it)."""
        with contextlib.suppress(ShardServeError):
            self.coordinators.call(method, request, timeout=RELEASE_TIMEOUT_S)

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

    def write_bytes(
        self, rank: int, request: pb.WriteBytesRequest, pieces: Sequence[torch.Tensor]
    ) -> int:
        """WriteBytes of `request`'s byte ranges to `rank`, their bytes `pieces` (flat uint8 CPU tensors, one per
        range): all in one call through a staging memfd where the rank is on this host and reads it, else inline
        in requests of at most INLINE_BYTES_PER_CALL each, one after another; returns the bytes written."""
        status = self.rank_status(rank)
        written = self.paths.write_bytes_in_memory(status, request, pieces)
        if written is not None:
            return written
        return sum(
            self._write_bytes_inline(status, request, batch)
            for batch in split_pieces(list(zip(request.starts, pieces)), INLINE_BYTES_PER_CALL)
        )

    def _write_bytes_inline(
        self,
        status: RankStatus,
        request: pb.WriteBytesRequest,
        batch: list[tuple[int, torch.Tensor]],
    ) -> int:
        inline = pb.WriteBytesRequest(
            name=request.name,
            version=request.version,
            shard_index=request.shard_index,
            starts=[start for start, _ in batch],
            lengths=[piece.numel() for _, piece in batch],
            data=b"".join(piece.numpy().data for _, piece in batch),
        )
        channel = self.channel
        reply = channel.unary(
            channel.shard_server(status.address).WriteBytes,
            inline,
            f"rank at {status.address}",
            timeout=channel.data_timeout(len(inline.data)),
        )
        return reply.bytes_written

    # ------------------------------------------------------------ coordinator calls

    def call(self, method: str, request: Any) -> Any:
        """The coordinator's unary `method` at the leader, with deadline and auth; errors as ShardServeErrors."""
        return self.coordinators.call(method, request)

    def follow(
        self,
        method: str,
        request: Any,
        work_timeout: float,
        report: Callable[[Any], None],
        refused: Callable[[ShardServeError], ShardServeError] | None = None,
    ) -> list[Any]:
        """The coordinator's progress stream `method` at the leader: report(message) for every message, in
        order; returns them (Coordinators.follow). An error is raised as `refused(error)` returns it, when
        given."""
        try:
            return self.coordinators.follow(method, request, work_timeout, report)
        except ShardServeError as error:
            raise (refused(error) if refused is not None else error) from None

    # ------------------------------------------------------------ ranks (client.ranks)

    def _list_ranks(self) -> list[RankStatus]:
        return catalog.ranks_listed(self.list_ranks())

    def list_ranks(self) -> pb.ListRanksResponse:
        """The coordinator's ListRanks answer now: the ranks, the epoch of collective jobs, metrics endpoints."""
        return self.call("ListRanks", catalog.list_ranks_request())

    def refresh_ranks(self) -> list[RankStatus]:
        """Every registered rank, fetched from the coordinator now (and kept for rank_status)."""
        return self.ranks.refresh()

    def recent_ranks(self, max_age_s: float = RECENT_RANKS_S) -> list[RankStatus]:
        """Every registered rank as the coordinator listed it at most `max_age_s` ago (a call only when
        older): for back-to-back puts that place their layouts over the live ranks."""
        return self.ranks.recent(max_age_s)

    def rank_status(self, rank: int) -> RankStatus:
        """The registered status of `rank` (address, host, shared memory), refreshed once if unknown."""
        return self.ranks.status(rank)

    def address_of(self, rank: int) -> str:
        """The address of `rank`'s shard server."""
        return self.ranks.status(rank).address

    # ------------------------------------------------------------ tensors

    def summary(self, name: str) -> TensorSummary:
        """The catalog entry of the READY tensor `name` (TensorNotFoundError if there is none)."""
        info = self.call("GetTensor", catalog.get_tensor_request(name))
        self.saw_version(info.name, info.version)
        return TensorSummary.from_proto(info)

    def saw_version(self, name: str, version: int) -> None:
        """Remember the newest version of `name` this client has seen committed (its own writes included)."""
        self.versions.saw(name, version)

    def newest_seen(self, name: str) -> int:
        """The newest version of `name` this client saw committed (0: none): a proxy cached at an older one
        reads the newer one instead, although ranks keep serving the older one for their grace period."""
        return self.versions.newest(name)

    def create_tensor(self, new: NewTensor, *, in_place: bool = False) -> pb.TensorInfo:
        """CreateTensor under a fresh put token. When the answer is lost (deadline, connection) the version may
        have been made anyway, with no one to write or abort it: the token aborts it (or, if the coordinator
        has not run the call yet, makes it refuse the call), instead of leaving it to the pending timeout.
        `in_place`: ranks on this host open the shards for this client's in-place writes (the answer's
        `writable`), where this client writes in place."""
        request = create_request(new, put_token=uuid.uuid4().hex)
        if in_place:
            request.writer_host_id = self.paths.in_place_host()
        try:
            return self.call("CreateTensor", request)
        except (DeadlineExceededError, RankUnavailableError):
            with contextlib.suppress(ShardServeError):
                self.call(
                    "AbortTensor",
                    pb.AbortTensorRequest(name=request.name, put_token=request.put_token),
                )
            raise

    def commit(self, name: str, version: int, *, written_in_place: bool = False) -> pb.TensorInfo:
        """CommitTensor of a pending version (`written_in_place`: this client filled the shards its create
        opened for it). When the answer is lost (deadline, connection) the commit may still have happened: then
        the READY version says so, and it counts as done rather than being reported failed while it is
        visible."""
        request = pb.CommitTensorRequest(
            name=name, version=version, written_in_place=written_in_place
        )
        try:
            committed = self.call("CommitTensor", request)
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


_INITS = {
    "none": pb.INIT_NONE,
    "zeros": pb.INIT_ZEROS,
    "ones": pb.INIT_ONES,
    "normal": pb.INIT_NORMAL,
    "arange": pb.INIT_ARANGE,
    "copy": pb.INIT_COPY,
}


def create_request(new: NewTensor, *, put_token: str) -> pb.CreateTensorRequest:
    """The CreateTensor request of `new`, under `put_token`."""
    return pb.CreateTensorRequest(
        name=new.name,
        metadata=metadata_to_proto(new.metadata),
        init=_INITS[new.init],
        seed=new.seed,
        overwrite=new.overwrite,
        options=options_to_proto(new.options),
        source_version=new.source_version,
        put_token=put_token,
        reserve=new.reserve,
    )
