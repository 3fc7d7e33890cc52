"""connect() and Cluster: the client's handle on a shardserve cluster (coordinator + ranks).

Cluster creates, puts, lists and deletes tensors through the coordinator and
hands out RemoteShardedTensor proxies for reading. A put is all-or-nothing: the
tensor is created PENDING, every shard streamed to its owner, then committed;
any failure aborts the pending version so no half tensor is ever visible.
"""

from __future__ import annotations

import builtins
import numbers
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client import catalog_requests as catalog
from shardserve.client.casts import put_dtype, stored_as
from shardserve.client.channel import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    Channel,
    Credentials,
)
from shardserve.client.embedding.lookup import Lookups
from shardserve.client.embedding.row_cache import CacheStats, RowCache
from shardserve.client.embedding.views import table_options
from shardserve.client.errors import (
    InvalidArgumentError,
    RankUnavailableError,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.new_tensor import NewTensor
from shardserve.client.ops import checkpoints
from shardserve.client.ops.puts import forget_reserved, put_tensor, put_whole_tensor
from shardserve.client.ops.row_updates import RowUpdate, update_rows, update_rows_ordered
from shardserve.client.ops.snapshots import SnapshotSummary, get_snapshot, list_snapshots
from shardserve.client.paths.hedging import HEDGE_AFTER_S
from shardserve.client.paths.kinds import PathKind, parse_transport
from shardserve.client.put_delta import put_delta
from shardserve.client.session import Session
from shardserve.client.snapshots import Snapshot
from shardserve.client.stamps import delta_mode
from shardserve.client.tensor import RemoteShardedTensor
from shardserve.client.tracing import call_interceptor
from shardserve.core.coordinator_addresses import parse_addresses
from shardserve.core.dtypes import dtype_from_name, dtype_to_wire
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.regions import cut_tensor
from shardserve.core.specs import tensor_size
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb

INIT_KINDS = ("zeros", "ones", "normal", "arange")  # the fills `create` offers


def connect(
    address: str,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    row_cache_bytes: int = 0,
    row_cache_max_age: float = 1.0,
    transport: str = "auto",
    hedge_after: float | None = HEDGE_AFTER_S,
    tracing: Any = None,
) -> Cluster:
    """Connect to the coordinator at HOST:PORT; fails fast if it cannot be reached or refuses the token.

    Several coordinators sharing one catalog are given as "HOST:PORT,HOST:PORT": the client calls the one that
    leads, follows a standby's NOT_LEADER answer to the leader, and during a failover waits for the new leader
    within each call's deadline (client/coordinators.py); reads of tensors it already holds go to the ranks and
    go on meanwhile.

    `row_cache_bytes` > 0 keeps an LRU cache of embedding rows of that many bytes (see client.embedding.row_cache);
    cached rows are used for at most `row_cache_max_age` seconds before the table's version is checked again.
    `transport` picks the data path of reads (client.paths.policy): "auto" (shared memory for ranks on this
    host, else the bulk path (the ranks' bulk port) for parts over 1 MiB without TLS, else gRPC; each falling
    back to the next when it fails), or one path forced: "grpc", "shm" or "bulk" (an error when a rank cannot be
    read that way; "tcp", the bulk path's old name, is accepted and deprecated).
    `hedge_after` (seconds, default 0.1; None or 0: off): a part of a read or lookup that has not answered this
    long (plus 2 ms per MB) is asked of another copy of its box too, and the first answer wins
    (client.paths.hedging); a part with no other copy ends with RankUnavailableError once the coordinator
    reports its rank dead, hedging or not.
    `tracing`: trace every gRPC call with OpenTelemetry, its context carried to the coordinator and the ranks
    (docs/operations.md#tracing): True (the application's global tracer provider), an OpenTelemetry
    TracerProvider, False (off), or None (the default: on when $SHARDSERVE_TRACING is set, not 0/off).
    """
    parse_addresses(address, "address")
    forced = parse_transport(transport)
    timeout = arguments.seconds(timeout, "timeout")
    row_cache_max_age = arguments.seconds(row_cache_max_age, "row_cache_max_age", allow_zero=True)
    hedge_after = (
        arguments.seconds(hedge_after, "hedge_after", allow_zero=True)
        if hedge_after is not None
        else None
    )
    cache = (
        RowCache(arguments.count(row_cache_bytes, "row_cache_bytes")) if row_cache_bytes else None
    )
    channel = Channel(
        Credentials(token, tls_ca, tls_cert, tls_key),
        timeout,
        interceptor=call_interceptor(tracing),
    )
    cluster = Cluster(
        address,
        channel,
        row_cache=cache,
        row_cache_max_age=row_cache_max_age,
        forced=forced,
        hedge_after=hedge_after,
    )
    try:
        cluster.session.refresh_ranks()
    except RankUnavailableError as err:
        cluster.close()
        raise RankUnavailableError(
            f"{err}{_tls_hint(str(err), tls_ca, tls_cert)}", err.code
        ) from None
    except BaseException:
        cluster.close()
        raise
    return cluster


def _tls_hint(message: str, tls_ca: str | None, tls_cert: str | None) -> str:
    """What to check when the first call found the coordinator but the connection did not hold (gRPC reports a
    TLS mismatch only as a closed socket or a failed handshake)."""
    if "Connection refused" in message:
        return ""
    if not tls_ca:
        return " (if the cluster serves TLS, pass tls_ca, and tls_cert/tls_key when it wants client certificates)"
    if not tls_cert:
        return (
            " (if the cluster wants client certificates (mutual TLS), pass tls_cert and tls_key; if it serves "
            "plaintext, pass no tls_ca)"
        )
    return " (if the cluster serves plaintext, pass no tls_ca/tls_cert/tls_key)"


class Cluster:
    """A connection to one shardserve cluster; use as a context manager or call close().

    `session` (client.session.Session) is the connection its proxies and helpers share; `lookups`
    (client.embedding.lookup.Lookups) holds the table views, the row cache and the path each rank answered by.
    """

    def __init__(
        self,
        address: str,
        channel: Channel,
        *,
        row_cache: RowCache | None = None,
        row_cache_max_age: float = 1.0,
        forced: PathKind | None = None,
        hedge_after: float | None = HEDGE_AFTER_S,
    ) -> None:
        self.address = address
        self.session = Session(address, channel, forced=forced, hedge_after=hedge_after)
        self.lookups = Lookups(self.session, row_cache, row_cache_max_age)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every channel, bulk connection, shared-memory mapping (unmapped once no tensor uses it) and
        the read pool."""
        self.session.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster(address={self.address!r}, ranks={self.session.ranks.known()})"

    # ------------------------------------------------------------ the catalog

    def _proxy(self, summary: TensorSummary) -> RemoteShardedTensor:
        return RemoteShardedTensor(self.session, self.lookups, summary)

    def ranks(self) -> list[RankStatus]:
        """Every registered rank (address, device, alive, memory), sorted by rank."""
        return sorted(self.session.refresh_ranks(), key=lambda r: r.rank)

    def list(self, include_pending: bool = False) -> list[TensorSummary]:
        """The catalog: every READY tensor (and PENDING ones when asked), sorted by name."""
        reply = self.session.call("ListTensors", catalog.list_tensors_request(include_pending))
        return catalog.tensors_listed(reply, include_pending)

    def tensor(self, name: str) -> RemoteShardedTensor:
        """A proxy of the READY tensor `name` (TensorNotFoundError if there is none)."""
        return self._proxy(self.session.summary(name))

    def __getitem__(self, name: str) -> RemoteShardedTensor:
        return self.tensor(name)

    def __contains__(self, name: str) -> bool:
        return any(t.name == name for t in self.list())

    def delete(self, name: str) -> None:
        """Remove `name` from the catalog and free its shards (TensorNotFoundError if unknown)."""
        self.session.call("DeleteTensor", catalog.delete_tensor_request(name))
        self.lookups.views.forget(name)

    # ------------------------------------------------------------ creating tensors

    def create(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype | str = torch.float32,
        spec: Any = None,
        *,
        init: str = "zeros",
        seed: int = 0,
        overwrite: bool = False,
        oov: str = "error",
        default_row: torch.Tensor | None = None,
        replicas: int = 1,
        durable: bool = True,
    ) -> RemoteShardedTensor:
        """Create a tensor filled on the ranks by `init` ("zeros", "ones", "normal" or "arange").

        `oov` says how embedding lookups answer ids out of range: "error", "zero" or "default" (`default_row`).
        `replicas` > 1 holds every box of the layout on that many live ranks (shardcore.replicas), each copy
        filled alike. `durable` False keeps the tensor (and its row updates) off the ranks' persist dirs.
        """
        arguments.tensor_name(name)
        replicas = arguments.count(replicas, "replicas", minimum=1)
        if init not in INIT_KINDS:
            raise InvalidArgumentError(f"init must be one of {sorted(INIT_KINDS)}, got {init!r}")
        if (
            isinstance(seed, bool)
            or not isinstance(seed, numbers.Integral)
            or not -(1 << 63) <= seed < 1 << 63
        ):
            raise InvalidArgumentError(f"seed must be a 64-bit int, got {seed!r}")
        overwrite = arguments.flag(overwrite, "overwrite")
        try:
            dtype = dtype_from_name(dtype)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"dtype: {err}") from None
        shape = _shape(shape)
        meta = self.session.layouts.layout(shape, dtype, spec, replicas)
        options = table_options(oov, default_row, shape, dtype)
        options = replace(options, durable=arguments.flag(durable, "durable"))
        info = self.session.create_tensor(
            NewTensor(name, meta, init=init, seed=int(seed), overwrite=overwrite, options=options)
        )
        self.lookups.views.forget(name)
        return self._proxy(TensorSummary.from_proto(info))

    def put(
        self,
        name: str,
        tensor: torch.Tensor,
        spec: Any = None,
        *,
        overwrite: bool = False,
        chunk_bytes: int = CHUNK_BYTES,
        oov: str = "error",
        default_row: torch.Tensor | None = None,
        replicas: int = 1,
        durable: bool = True,
        dtype: torch.dtype | str | None = None,
        delta: bool | str = False,
        reserve_next: bool = True,
    ) -> RemoteShardedTensor:
        """Cut `tensor` by `spec`, write every shard to its owner (each rank's by its fastest path; `chunk_bytes`:
        the message size of shards streamed over gRPC) and commit; nothing is visible on failure.

        `replicas` > 1 holds every box on that many live ranks (shardcore.replicas); every copy is written.
        `durable` (default True) persists the tensor on ranks with a persist dir before the put returns; False
        keeps it in memory only (weights republished every step: a rank's restart loses it).
        `dtype` (a floating dtype) stores a floating `tensor` converted to it, bit for bit `tensor.to(dtype)`,
        converted while copying into the ranks' memory or into the bytes sent; an integer or bool tensor is
        stored as it is.
        `delta` (with `overwrite`): send and store only the blocks (about 1 MiB of rows each) whose bytes changed
        since this client's last put of `name`, the rest shared with that version on the ranks
        (client/put_delta.py); a full put when there is none, the layout or options changed, or another writer
        put the name since. `delta="version_counters"`: the same, except that a shard whose torch version
        counter counted no write since that put is taken as unchanged without reading it (client/stamps.py).
        `reserve_next` (with `overwrite`, not a delta): once a name was put twice in a row by this client with
        the same layout and options, reserve its next version after each put returns, on the client's
        reservation thread, so that the next put fills it with no create on its path (its memory is held on
        the ranks until then, the client's close, or the coordinator's pending timeout; another writer's put or
        a row update of the name drops it, and the next put then creates one: client/tensor_reservations.py).
        """
        arguments.tensor_name(name)
        replicas = arguments.count(replicas, "replicas", minimum=1)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        arguments.dense_tensor(tensor, "tensor")
        overwrite = arguments.flag(overwrite, "overwrite")
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, numbers.Integral)
            or not 0 < chunk_bytes <= MAX_CHUNK_BYTES
        ):
            raise InvalidArgumentError(
                f"chunk_bytes must be an int in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes!r}"
            )
        try:
            dtype_to_wire(tensor.dtype)
        except ValueError as err:
            raise InvalidArgumentError(f"tensor dtype: {err}") from None
        reserve_next = arguments.flag(reserve_next, "reserve_next")
        stored = stored_as(tensor.dtype, put_dtype(dtype), name)
        options = table_options(oov, default_row, tuple(tensor.shape), stored)
        options = replace(options, durable=arguments.flag(durable, "durable"))

        def lay_out(recent: bool) -> ShardedTensorMetadata:
            return self.session.layouts.layout(
                tuple(tensor.shape), stored, spec, replicas, recent=recent
            )

        # a CUDA tensor stays where it is: a same-host rank takes its shards device to device (CUDA ranks) or
        # into registered segments (CPU ranks); the network paths copy each shard to the host as they send it
        is_delta, trusted = delta_mode(delta)
        if is_delta:
            if not overwrite:
                raise InvalidArgumentError(
                    f"delta={delta!r} needs overwrite=True (a delta replaces a version)"
                )
            committed = self._put_delta(
                name, tensor.detach(), lay_out(False), options, chunk_bytes, trusted
            )
        else:
            committed = put_tensor(
                self.session,
                name,
                tensor.detach(),
                lay_out,
                options,
                overwrite=overwrite,
                chunk_bytes=chunk_bytes,
                reserve_next=reserve_next,
            )
        self.lookups.views.forget(name)
        return self._proxy(TensorSummary.from_proto(committed))

    def _put_delta(
        self,
        name: str,
        tensor: torch.Tensor,
        meta: ShardedTensorMetadata,
        options: TensorOptions,
        chunk_bytes: int,
        trusted: bool,
    ) -> pb.TensorInfo:
        """A delta put of `tensor` laid out as `meta` (client/put_delta.py); it neither uses nor makes a
        reservation (it gives back the name's)."""
        forget_reserved(self.session, name)
        shards = cut_tensor(tensor, meta)
        return put_delta(
            self.session,
            name,
            shards,
            layout=meta,
            options=options,
            put_whole=lambda: put_whole_tensor(
                self.session,
                name,
                meta,
                shards,
                options,
                overwrite=True,
                chunk_bytes=chunk_bytes,
            ),
            trusted=trusted,
        )

    # ------------------------------------------------------------ snapshots (client.ops.snapshots, client.spmd)

    def snapshot(self, prefix: str, number: int | None = None) -> Snapshot:
        """Committed snapshot `number` of `prefix` (None: the newest): its tensors, every one at that snapshot."""
        return Snapshot(self.session, self.lookups, get_snapshot(self.session, prefix, number))

    def snapshots(self, prefix: str) -> builtins.list[SnapshotSummary]:
        """The kept snapshots of `prefix`, oldest first: number, tensors, bytes, age."""
        return list_snapshots(self.session, prefix)

    # ------------------------------------------------------------ embedding serving (client.embedding.lookup)

    def lookup(
        self, requests: dict[str, Any], dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Rows of several 2-D tables, {name: ids} -> {name: Tensor[len(ids), dim]}, one round trip per rank."""
        if not isinstance(requests, dict):
            raise TypeError(
                f"requests must be a dict of table name -> ids, got {type(requests).__name__}"
            )
        for name in requests:
            arguments.tensor_name(name)
        return self.lookups.lookup(requests, dtype)

    def update_rows(self, name: str, ids: Any, values: torch.Tensor) -> int:
        """Replace rows of a 2-D table in a new version, atomically (see client.ops.row_updates); returns it."""
        return update_rows(
            self.session, self.lookups.views, arguments.tensor_name(name), ids, values
        )

    def update_rows_ordered(self, name: str, ids: Any, values: torch.Tensor) -> RowUpdate:
        """update_rows, answering (version, order): updates from several clients grouped into one version are
        applied in `order` (a later one's rows win), versions in their order."""
        return update_rows_ordered(
            self.session, self.lookups.views, arguments.tensor_name(name), ids, values
        )

    def row_cache_stats(self) -> CacheStats | None:
        """Hits, misses and size of the row cache (None when connect() got no row_cache_bytes)."""
        cache = self.lookups.cache
        return cache.stats() if cache is not None else None

    # ------------------------------------------------------------ DCP checkpoints (client.ops.checkpoints)

    def load_checkpoint(
        self,
        path: str,
        names: Sequence[str] | str | None = None,
        *,
        spec: Any = None,
        dtype: torch.dtype | str | None = None,
        overwrite: bool = False,
        progress: Callable[[int, int], None] | None = None,
        timeout: float = 600.0,
        replicas: int = 1,
    ) -> dict[str, RemoteShardedTensor]:
        """Load tensors of the DCP checkpoint at `path` (every rank reads its own shards); all appear or none.

        `spec` (one for all, or {name: spec}) lays them out (default: row-wise over every live rank), each box on
        `replicas` live ranks; `progress(bytes_done, bytes_total)` is called as the ranks report.
        """
        loaded = checkpoints.load_checkpoint(
            self.session,
            path,
            names,
            spec=spec,
            dtype=dtype,
            overwrite=overwrite,
            progress=progress,
            timeout=timeout,
            replicas=replicas,
        )
        for summary in loaded:
            self.lookups.views.forget(summary.name)
        return {summary.name: self._proxy(summary) for summary in loaded}

    def save_checkpoint(
        self,
        path: str,
        names: Sequence[str] | str | None = None,
        progress: Callable[[int, int], None] | None = None,
        timeout: float = 600.0,
    ) -> builtins.list[str]:
        """Write READY tensors (all by default) as one DCP checkpoint at `path`; torch's dcp.load reads it."""
        return checkpoints.save_checkpoint(self.session, path, names, progress, timeout)

    def inspect_checkpoint(self, path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (size, dtype)} of the tensors of the DCP checkpoint at `path`."""
        return checkpoints.inspect_checkpoint(self.session, path)


def _shape(shape: Any) -> tuple[int, ...]:
    """`shape` as a tuple of non-negative ints (shardcore's size check); InvalidArgumentError naming it otherwise."""
    try:
        dims = tuple(shape)
        size = tensor_size(dims)
    except TypeError:
        raise InvalidArgumentError(f"shape must be a sequence of ints, got {shape!r}") from None
    except ValueError:
        raise InvalidArgumentError(f"shape {dims} has a negative size") from None
    if any(n >= arguments.INT64_LIMIT for n in size):
        raise InvalidArgumentError(f"shape {size} has a size of 2**63 or more")
    return size
