"""Embedding lookups from the client: dedup, route to shards, one Lookup call per rank, caller's order back.

`TableView` is what a lookup needs of a table at one version: its layout, a
`RowIndex` for vectorized routing, and its out-of-range policy. `Lookups`
holds one view per table (refreshed when a rank no longer serves its
version, so an answer never mixes versions) and runs:

- rows: distinct ids are looked up once (from the optional row cache first),
  routed to one replica of each row band (every column shard of it), asked of
  all ranks in parallel with one Lookup call per rank carrying every table's
  items, and put back in the caller's order.
- bags: each shard pools the ids it owns into per-bag partial sums and counts
  on the server (only pooled rows travel); the client adds them up
  (shardcore.embedding.combine_partials). A bag whose ids all live on one
  shard is bit for bit `F.embedding_bag`; a bag spread over shards is summed
  in another order (within a few ulps). `pooling="client"` fetches the rows
  and pools them locally instead, bit for bit in every case; the client does
  that by itself when a request holds out-of-range ids answered with
  zero/default rows, and (with pooling="auto") when a row cache is on or
  every rank of the table is read through shared memory (same host: the rows
  cost no transfer, so pooling here is both exact and cheapest).

Same-host ranks answer from their mapped shards in the calling thread; the
ranks left over get one call each, over their bulk port (every request sent
from the calling thread before any answer is awaited) or over gRPC.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import grpc
import numpy as np
import torch

from client.paths.policy import NetworkCall, SentCalls
from client.arguments import dense_tensor
from client.errors import (InvalidArgumentError, ShardServeError, StaleVersionError,
                           error_from_rpc)
from client.info import TensorSummary
from client.embedding.mapped_rows import MappedRows
from client.retry import read_with_refresh
from client.channel import SHARD_SERVICE
from protos import shardserve_pb2 as pb
from protos.chunk_codec import RawLookupChunk, decode_lookup_chunk, decode_lookup_reply
from shardcore.dtypes import dtype_from_wire
from shardcore.embedding import (PartialBags, accumulation_dtype, bag_subset, combine_partials, pool_bags,
                                 validate_ids)
from shardcore.routing import RowIndex, distinct_ids, unique_ids
from shardcore.wire import tensor_bytes

if TYPE_CHECKING:
    from client.cluster import Cluster
    from client.embedding.row_cache import RowCache

# Answers up to this many bytes (the ranks' SMALL_REPLY_BYTES) come in one LookupSmall message, larger ones stream:
# one message beat the stream at 512 KiB and at 2 MiB per rank (a stream costs about twice a unary call).
SMALL_ANSWER_BYTES = 4 << 20
_CHUNK_FRAMING_BYTES = 128  # a LookupChunk's fields but data and counts, with its tag and length in LookupReply
_OOV_NAMES = {pb.OOV_ERROR: "error", pb.OOV_ZERO: "zero", pb.OOV_DEFAULT: "default"}
POOLINGS = ("auto", "server", "client")
# A lookup's own CPU work (a mapped lookup's gather, client-side pooling; a routed one's planning, answer decoding
# and assembly, but never a wait for an answer: the turn is not held while gRPC calls on the client's pool,
# which take it too, are awaited; sends hold it, and so does opening a bulk connection where a rank has none
# kept) runs under the GIL: threads doing it at once only hand the GIL back and forth
# at every call into torch, numpy or protobuf (8 threads were 3.5x slower per mapped lookup than one; 8 routed
# 512-id lookups over gRPC took 2.1 ms each, 1.6 ms with turns), so they take turns on this process-wide lock.
_CPU_TURN = threading.RLock()
OOV_RECHECK_S = 1.0  # how old a table view may be when ids out of its range are answered from it alone


@dataclass(frozen=True, eq=False)
class TableView:
    """A 2-D table at one version: layout, routing index, out-of-range policy and default row."""

    summary: TensorSummary
    oov: str
    default_row: torch.Tensor | None
    index: RowIndex = field(repr=False)

    @classmethod
    def from_info(cls, info: pb.TensorInfo) -> "TableView":
        summary = TensorSummary.from_proto(info)
        meta = summary.metadata
        if meta.ndim != 2:
            raise InvalidArgumentError(f"tensor {info.name!r} has shape {meta.size}; lookups need a 2-D table")
        oov = _OOV_NAMES.get(info.options.oov, "error")
        default = None
        if oov == "default":
            default = torch.frombuffer(bytearray(info.options.default_row), dtype=meta.dtype).clone()
        return cls(summary, oov, default, RowIndex(meta))

    @property
    def name(self) -> str:
        return self.summary.name

    @property
    def version(self) -> int:
        return self.summary.version

    @property
    def dim(self) -> int:
        return self.summary.metadata.size[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.summary.metadata.dtype

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The ranks holding shards of the table (sorted)."""
        return tuple(sorted({shard.rank for shard in self.summary.metadata.shards_metadata}))

    @property
    def complete(self) -> bool:
        """Whether every row 0..rows-1 is held whole by the layout (then only the range needs checking)."""
        return self.index.covers_every_row

    def invalid(self, sorted_ids: np.ndarray) -> np.ndarray | None:
        """Mask of the ids no shard holds (out of range or in a hole), or None when there is none."""
        if not sorted_ids.size:
            return None
        if self.complete and sorted_ids[0] >= 0 and sorted_ids[-1] < self.summary.metadata.size[0]:
            return None
        bad = self.index.invalid_array(sorted_ids)
        return bad if bool(bad.any()) else None

    def fill_row(self) -> torch.Tensor:
        """What an out-of-range id looks up under this table's policy (zero or default)."""
        return self.default_row if self.default_row is not None else torch.zeros(self.dim, dtype=self.dtype)


@dataclass
class _Item:
    """One LookupItem and where its answer goes; the ids go into the message only when it is sent."""

    view: TableView
    rank: int
    columns: slice  # the table columns the shard holds (slice(None): all)
    message: pb.LookupItem
    ids: torch.Tensor
    positions: np.ndarray | None = None  # row items: the answer's rows' places among the plan's distinct ids
    answer: Any = None  # rows tensor, or PartialBags for pooled items

    @property
    def width(self) -> int:
        """The number of table columns the answer holds."""
        return self.view.dim if self.columns == slice(None) else self.columns.stop - self.columns.start

    def wire_message(self) -> pb.LookupItem:
        """The message with its ids as raw int64 bytes (filled on first use)."""
        if not self.message.ids and self.ids.numel():
            self.message.ids = bytes(tensor_bytes(self.ids))
        return self.message


@dataclass
class BagRequest:
    """A lookup_bag request of one table, checked."""

    ids: torch.Tensor
    offsets: torch.Tensor
    mode: str
    weights: torch.Tensor | None


def as_ids(ids: Any, field_name: str = "ids") -> torch.Tensor:
    """1-D int64 CPU ids from a tensor, a numpy array or a sequence of ints; InvalidArgumentError/TypeError name
    the field."""
    if isinstance(ids, torch.Tensor):
        dense_tensor(ids, field_name)
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{field_name} must hold integers, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidArgumentError(f"{field_name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype == torch.uint64 and bool((ids.view(torch.int64) < 0).any()):  # 2**63 and up, seen as int64
            raise InvalidArgumentError(f"{field_name} holds values of 2**63 or more, past the int64 range of row ids")
        return ids.detach().to("cpu", torch.int64).contiguous()
    if isinstance(ids, (str, bytes, bytearray, dict, set, frozenset)):  # unordered, or not ids at all
        raise TypeError(f"{field_name} must be a tensor or a sequence of ints, got {type(ids).__name__}")
    try:
        array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{field_name} must be a tensor or a sequence of ints: {err}") from None
    if array.size and array.dtype.kind not in "iu":  # floats are not cut to ints, nor bools taken for 0 and 1
        raise TypeError(f"{field_name} must hold integers, got {array.dtype} values")
    if array.ndim != 1:
        raise InvalidArgumentError(f"{field_name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "u" and array.size and int(array.max()) >= 1 << 63:
        raise InvalidArgumentError(f"{field_name} holds {int(array.max())}, past the int64 range of row ids")
    return torch.from_numpy(array.astype(np.int64))


def _bad_id_error(view: TableView, ids: torch.Tensor, bad: torch.Tensor) -> InvalidArgumentError:
    position = int(bad.nonzero()[0, 0])
    rows = view.summary.metadata.size[0]
    return InvalidArgumentError(
        f"ids[{position}]={int(ids[position])} is out of range for table {view.name!r} of {rows} rows "
        f"({int(bad.sum())} bad id(s) in all; the table's oov policy is 'error')", grpc.StatusCode.INVALID_ARGUMENT)


class Lookups:
    """Table views of one cluster and the lookup calls over them."""

    def __init__(self, cluster: "Cluster", cache: "RowCache | None" = None, cache_max_age: float = 1.0) -> None:
        self._cluster = cluster
        self.cache = cache
        self.cache_max_age = cache_max_age
        self._views: dict[str, TableView] = {}
        self._rank_methods: dict[str, Any] = {}
        self.last_paths: dict[int, str] = {}  # rank -> "shm", "tcp", "grpc" or "shm+tcp"...: its latest answer's path
        self._fetched: dict[str, float] = {}
        self._mapped: dict[str, tuple[TableView, MappedRows | None]] = {}  # name -> the fast path of its view
        self._lock = threading.Lock()

    # ------------------------------------------------------------ views

    def view(self, name: str, refresh: bool = False) -> TableView:
        """The cached view of `name` (fetched from the coordinator when missing or when asked).

        With a row cache, lookups answered from it alone never reach a rank that would say the version
        is stale, so the view is also refreshed when older than `cache_max_age` seconds.
        """
        with self._lock:
            view = self._views.get(name)
            if self.cache is not None and time.monotonic() - self._fetched.get(name, 0.0) > self.cache_max_age:
                refresh = True
        if view is None or refresh:
            info = self._cluster._call("GetTensor", pb.GetTensorRequest(name=name))
            with self._lock:
                old = self._views.get(name)
            view = old if old is not None and old.version == info.version else TableView.from_info(info)
            with self._lock:
                old = self._views.get(name)
                if old is None or old.version <= view.version:
                    self._views[name] = view
                view = self._views[name]
                self._fetched[name] = time.monotonic()
            if self.cache is not None:
                self.cache.invalidate_older(name, view.version)
        return view

    def forget(self, name: str) -> None:
        with self._lock:
            self._views.pop(name, None)

    def _recheck_bad_ids(self, view: TableView) -> None:
        """Ids the cached view finds out of range, which no rank is asked about, may be in range of a newer
        version (the table was replaced, perhaps by another client): a view older than OOV_RECHECK_S is fetched
        again first, and a newer version retries the lookup (StaleVersionError) rather than answer the old
        layout's error or out-of-range rows."""
        with self._lock:
            fetched = self._fetched.get(view.name, 0.0)
        if time.monotonic() - fetched < OOV_RECHECK_S:
            return
        fresh = self.view(view.name, refresh=True)
        if fresh.version != view.version:
            raise StaleVersionError(f"table {view.name!r} is at version {fresh.version}, not {view.version}",
                                    grpc.StatusCode.FAILED_PRECONDITION)

    def _with_retry(self, names: Sequence[str], run):  # type: ignore[no-untyped-def]
        """run(views) at the cached versions; on a stale version refresh every table and retry."""
        def refresh() -> tuple[int, ...]:
            self._cluster._refresh_ranks()
            return tuple(self.view(name, refresh=True).version for name in names)

        return read_with_refresh(lambda: run({name: self.view(name) for name in names}), refresh)

    # ------------------------------------------------------------ rows

    def lookup(self, requests: Mapping[str, Any], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Rows [len(ids), dim] of several tables, one Lookup call per rank."""
        self._cluster._transport.check_open()
        ids = {name: as_ids(value, f"ids[{name!r}]") for name, value in requests.items()}
        _check_dtype(dtype)
        return self._with_retry(list(ids), lambda views: self._lookup_once(views, ids, dtype))

    def _lookup_once(self, views: dict[str, TableView], ids: dict[str, torch.Tensor],
                     dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Each table from its mapped shards when it can (client.embedding.mapped_rows), the rest by routed Lookup calls."""
        results, rest = {}, {}
        for name, table_ids in ids.items():
            mapped = self._mapped_rows(views[name])  # may map shards (an OpenShard call): outside the turn
            with _CPU_TURN:
                rows = mapped.rows(table_ids) if mapped is not None else None
            if rows is None:
                rest[name] = table_ids
                continue
            results[name] = rows if dtype is None else rows.to(dtype)
            self.last_paths.update((rank, "shm") for rank in views[name].ranks)
        if rest:
            results.update(self._lookup_routed(views, rest, dtype))
        return {name: results[name] for name in ids}

    def _mapped_rows(self, view: TableView) -> MappedRows | None:
        """The mapped fast path of `view` (built once per version; retried while ranks are not all mapped)."""
        if self.cache is not None:
            return None  # the row cache counts hits and misses per row: the general path keeps it exact
        known = self._mapped.get(view.name)
        if known is not None and known[0] is view and (known[1] is not None or not self._all_mapped(view)):
            return known[1]
        built = MappedRows.build(view, self._cluster) if self._all_mapped(view) else None
        self._mapped[view.name] = (view, built)
        return built

    def _lookup_routed(self, views: dict[str, TableView], ids: dict[str, torch.Tensor],
                       dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        items: list[_Item] = []
        with _CPU_TURN:
            plans = {name: _RowPlan.of(views[name], table_ids) for name, table_ids in ids.items()}
        for plan in plans.values():
            if plan.bad is not None:
                self._recheck_bad_ids(plan.view)  # may ask the coordinator: outside the turn
        with _CPU_TURN:
            for name, plan in plans.items():
                if plan.bad is not None and plan.view.oov == "error":
                    raise _bad_id_error(plan.view, ids[name], plan.bad_per_id())
                plan.wanted = self._from_cache(plan)
                items.extend(plan.items())
            exchange = self._send_calls(items)
        exchange.wait()
        with _CPU_TURN:
            exchange.finish()
            return {name: self._rows_of(plan, [item for item in items if item.view is plan.view], dtype)
                    for name, plan in plans.items()}

    def _rows_of(self, plan: "_RowPlan", items: list[_Item], dtype: torch.dtype | None) -> torch.Tensor:
        """The rows asked of one table, in the caller's order, from its answered items (and into the cache)."""
        rows = plan.distinct_rows(items)
        if self.cache is not None and plan.wanted.size:
            self.cache.put_many(plan.view.name, plan.view.version, plan.unique[plan.wanted].tolist(),
                                rows[torch.from_numpy(plan.wanted)])
        rows = plan.in_callers_order(rows)
        return rows if dtype is None else rows.to(dtype)

    def _from_cache(self, plan: "_RowPlan") -> np.ndarray | None:
        """Fill the plan's rows from the row cache; return the positions (in plan.unique) still to fetch, or
        None for all of them."""
        todo = None if plan.bad is None else np.flatnonzero(~plan.bad)
        if self.cache is None:
            return todo
        if todo is None:
            todo = np.arange(plan.unique.size)
        if not todo.size:
            return todo
        keys = plan.unique[todo].tolist()
        found = self.cache.get_many(plan.view.name, plan.view.version, keys)
        if not found:
            return todo
        hit = np.fromiter((k in found for k in keys), dtype=bool, count=len(keys))
        plan.rows()[torch.from_numpy(todo[hit])] = torch.stack([found[k] for k in keys if k in found])
        return todo[~hit]

    # ------------------------------------------------------------ bags

    def lookup_bag(self, name: str, ids: Any, offsets: Any, mode: str = "mean",
                   per_sample_weights: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                   pooling: str = "auto") -> torch.Tensor:
        """Pooled bags [len(offsets), dim] with nn.EmbeddingBag semantics (include_last_offset=False)."""
        self._cluster._transport.check_open()
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        _check_dtype(dtype)
        request = _bag_request(as_ids(ids), as_ids(offsets, "offsets"), mode, per_sample_weights)
        pooled = self._with_retry([name], lambda views: self._bag_once(views[name], request, pooling))
        return pooled if dtype is None else pooled.to(dtype)

    def _bag_once(self, view: TableView, request: BagRequest, pooling: str) -> torch.Tensor:
        weights = request.weights
        if weights is not None and weights.dtype != view.dtype:
            raise InvalidArgumentError(f"per_sample_weights has dtype {weights.dtype} but table {view.name!r} "
                                       f"is {view.dtype}; torch's embedding_bag needs the same dtype")
        bad = view.index.invalid_mask(request.ids)
        if bool(bad.any()):
            self._recheck_bad_ids(view)
            if view.oov == "error":
                raise _bad_id_error(view, request.ids, bad)
        if pooling == "client" or bool(bad.any()) or (pooling == "auto" and (self.cache is not None
                                                                              or self._all_mapped(view))):
            rows = self._lookup_once({view.name: view}, {view.name: request.ids}, None)[view.name]
            with _CPU_TURN:
                return pool_bags(rows, request.offsets, request.mode, weights)
        num_bags = request.offsets.numel()
        routes = view.index.route(request.ids, invalid="skip")
        if not routes:
            return torch.zeros((num_bags, view.dim), dtype=view.dtype)
        items = []
        for route in routes:
            order, sub_offsets = bag_subset(request.offsets, route.positions, request.ids.numel())
            positions = route.positions[order]
            message = pb.LookupItem(name=view.name, version=view.version, shard_index=route.shard, pooled=True,
                                    offsets=bytes(tensor_bytes(sub_offsets)))
            if weights is not None:
                message.per_sample_weights = bytes(tensor_bytes(weights[positions].contiguous()))
            items.append(_Item(view, route.rank, route.columns, message, request.ids[positions]))
        self._call_ranks(items)
        sizes = torch.diff(request.offsets, append=request.offsets.new_tensor([request.ids.numel()]))
        try:
            return combine_partials(_split_columns([item.answer for item in items]), request.mode, view.dtype, sizes)
        except ValueError as err:
            raise ShardServeError(f"ranks answered inconsistent partial bags for {view.name!r}: {err}") from None

    # ------------------------------------------------------------ the calls

    def _all_mapped(self, view: TableView) -> bool:
        """Whether every rank holding `view` is read through shared memory now (then pooling on this side costs
        no transfer and is bit for bit F.embedding_bag)."""
        plane = self._cluster._data_plane
        return all(plane.maps(self._cluster._rank_status(rank)) for rank in view.ranks)

    def _call_ranks(self, items: list[_Item]) -> None:
        """Give every item its answer: the calls sent and the answers decoded under the process-wide CPU turn,
        the waits outside it."""
        with _CPU_TURN:
            exchange = self._send_calls(items)
        exchange.wait()
        with _CPU_TURN:
            exchange.finish()

    def _send_calls(self, items: list[_Item]) -> "_Exchange":
        """Answer what mapped shards can in this thread, then start one Lookup call per remaining rank (the
        bulk port's requests all sent here, gRPC calls on the transport's threads)."""
        by_rank: dict[int, list[_Item]] = defaultdict(list)
        for item in items:
            by_rank[item.rank].append(item)
        exchange = _Exchange(self)
        for rank, group in sorted(by_rank.items()):
            rest = self._answer_through_shared_memory(rank, group)
            if not rest:
                self.last_paths[rank] = "shm"
                continue
            receiver = _Receiver(rest, f"rank {rank} at {self._cluster._address_of(rank)}")
            exchange.ranks.append((rank, len(rest) < len(group)))
            exchange.receivers.append(receiver)
            exchange.calls.append(self._network_call(rank, receiver))
        if exchange.calls:
            exchange.sent = self._cluster._data_plane.send_all(exchange.calls, self._cluster._transport.submit)
        return exchange

    def _network_call(self, rank: int, receiver: "_Receiver") -> NetworkCall:
        """One lookup call to `rank` for the receiver's items, over the bulk port or gRPC. Either way an answer
        up to SMALL_ANSWER_BYTES comes in one message; over gRPC a larger one streams (and so does not take
        the bulk port). A bulk answer is kept whole and decoded in finish()."""
        address = self._cluster._address_of(rank)
        request = pb.LookupRequest(items=[item.wire_message() for item in receiver.items])
        expected = sum(_answer_bytes(item) for item in receiver.items)

        def send_bulk() -> Callable[[], None]:
            answer = self._cluster._bulk.send_lookup(address, request, _reply_bytes(receiver.items))

            def take_answer() -> None:
                receiver.reply = answer()
            return take_answer

        return NetworkCall(self._cluster._rank_status(rank), send_bulk if expected <= SMALL_ANSWER_BYTES else None,
                           lambda: self._call_grpc(address, request, expected, receiver))

    def _call_grpc(self, address: str, request: pb.LookupRequest, expected: int, receiver: "_Receiver") -> None:
        """LookupSmall (an answer up to SMALL_ANSWER_BYTES) or the Lookup stream, into `receiver` (finished by
        the caller)."""
        transport = self._cluster._transport
        methods = self._methods(address)
        timeout = transport.data_timeout(expected)
        try:
            if expected <= SMALL_ANSWER_BYTES:
                chunks = methods.small(request, timeout=timeout, metadata=transport._metadata)
            else:
                chunks = methods.stream(request, timeout=timeout, metadata=transport._metadata)
            for chunk in chunks:  # a streamed answer waits for its next chunk outside the turn
                with _CPU_TURN:
                    receiver.add(chunk)
        except grpc.RpcError as err:
            raise error_from_rpc(err, receiver.where) from None

    def _answer_through_shared_memory(self, rank: int, items: list[_Item]) -> list[_Item]:
        """Answer row items of a same-host rank from its mapped shards (client.paths.shm); return the rest.

        Any size: a mapped read skips the round trip, 3-4x faster than gRPC even for one id."""
        if all(item.message.pooled for item in items):
            return items
        status, plane, rest = self._cluster._rank_status(rank), self._cluster._data_plane, []
        for item in items:
            rows = None
            if not item.message.pooled:
                rows = plane.lookup_rows(status, item.view.summary, item.message.shard_index, item.ids)
            if rows is None:
                rest.append(item)
            else:
                item.answer = rows
        return rest

    def _methods(self, address: str) -> "_LookupMethods":
        """The lookup calls of `address`, made once (making them per call costs as much as a small lookup).

        Answers are decoded by protos.chunk_codec: rows stay views into the received message until they are
        copied into place, where protobuf would copy them twice first."""
        methods = self._rank_methods.get(address)
        if methods is None:
            channel = self._cluster._transport.channel(address)
            methods = self._rank_methods[address] = _LookupMethods(
                channel.unary_unary(f"{SHARD_SERVICE}/LookupSmall", request_serializer=pb.LookupRequest.SerializeToString,
                                    response_deserializer=decode_lookup_reply),
                channel.unary_stream(f"{SHARD_SERVICE}/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                     response_deserializer=decode_lookup_chunk))
        return methods


class _LookupMethods(NamedTuple):
    """A rank's two lookup calls, their answers decoded by protos.chunk_codec."""

    small: Any  # LookupSmall -> list[RawLookupChunk]
    stream: Any  # Lookup -> iterator of RawLookupChunk


@dataclass
class _Exchange:
    """One lookup's calls to the ranks once sent: wait() outside the CPU turn, then finish() inside it."""

    lookups: Lookups
    ranks: list[tuple[int, bool]] = field(default_factory=list)  # per call: rank, and whether shm answered some
    receivers: list["_Receiver"] = field(default_factory=list)
    calls: list[NetworkCall] = field(default_factory=list)
    sent: SentCalls | None = None
    paths: list[str] = field(default_factory=list)

    def wait(self) -> None:
        """Every answer received (raises the first failure once all calls ended)."""
        if self.sent is not None:
            self.paths = self.sent.wait()

    def finish(self) -> None:
        """Every item answered; the path of each rank recorded in Lookups.last_paths."""
        for receiver in self.receivers:
            receiver.finish()
        for (rank, mapped), path in zip(self.ranks, self.paths):
            self.lookups.last_paths[rank] = f"shm+{path}" if mapped else path


@dataclass
class _RowPlan:
    """One table's rows in a lookup: its distinct ids, those no shard holds, which are fetched, and the rows.

    Ids are handled with numpy on the calling thread: a lookup takes a dozen small array steps, ~1 us each
    this way against ~5-10 us per torch call (with torch, a one-id lookup spent ~225 us of client CPU around
    its gRPC call, about as much as the call itself), and torch's index kernels run OpenMP regions whose
    idle threads spin (see _byte_rows)."""

    view: TableView
    unique: np.ndarray  # sorted distinct ids
    inverse: np.ndarray | None  # per id asked, its place in unique; None when the ids were sorted and distinct
    bad: np.ndarray | None  # over unique: ids no shard holds (None: none)
    wanted: np.ndarray | None = None  # the places in unique to fetch (None: all)
    out: torch.Tensor | None = None

    @classmethod
    def of(cls, view: TableView, ids: torch.Tensor) -> "_RowPlan":
        values = ids.numpy()
        if values.size <= 1 or bool((values[1:] > values[:-1]).all()):
            return cls(view, values, None, view.invalid(values))
        unique, inverse = distinct_ids(values)
        return cls(view, unique, inverse, view.invalid(unique))

    def bad_per_id(self) -> torch.Tensor:
        """The invalid-id mask over the ids as asked (for the error naming the first one)."""
        assert self.bad is not None
        return torch.from_numpy(self.bad if self.inverse is None else self.bad[self.inverse])

    def rows(self) -> torch.Tensor:
        """The rows of the distinct ids, allocated on first use."""
        if self.out is None:
            self.out = torch.empty((self.unique.size, self.view.dim), dtype=self.view.dtype)
        return self.out

    def items(self) -> list[_Item]:
        """One item per shard holding wanted ids (every column shard of their row band)."""
        fetch = self.unique if self.wanted is None else self.unique[self.wanted]
        items = []
        for route in self.view.index.route(fetch, invalid="skip"):
            positions = route.positions.numpy()
            message = pb.LookupItem(name=self.view.name, version=self.view.version, shard_index=route.shard)
            items.append(_Item(self.view, route.rank, route.columns, message, torch.from_numpy(fetch[positions]),
                               positions if self.wanted is None else self.wanted[positions]))
        return items

    def distinct_rows(self, items: list[_Item]) -> torch.Tensor:
        """The rows of the distinct ids from the answered items, the cache and the out-of-range policy.

        One answer holding every row whole (all distinct ids on one shard of full width) is used as is."""
        if (self.out is None and self.bad is None and len(items) == 1 and items[0].width == self.view.dim
                and items[0].positions.size == self.unique.size and items[0].answer.dtype == self.view.dtype):
            return items[0].answer  # positions are 0..n-1: a route of sorted ids keeps their order
        out = self.rows()
        out_bytes, itemsize = _byte_rows(out), out.element_size()
        for item in items:
            answer = item.answer if item.answer.dtype == out.dtype else item.answer.to(out.dtype)
            first = (item.columns.start or 0) * itemsize
            out_bytes[item.positions, first:first + item.width * itemsize] = _byte_rows(answer)
        if self.bad is not None:
            out[torch.from_numpy(self.bad)] = self.view.fill_row()
        return out

    def in_callers_order(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the distinct ids put in the order (and with the repeats) of the ids asked."""
        return rows if self.inverse is None else _gather_rows(rows, self.inverse)


def _split_columns(partials: list[PartialBags]) -> list[PartialBags]:
    """Partials cut at every column boundary of any of them, so row bands split by other columns combine."""
    cuts = sorted({p.col_offset for p in partials} | {p.col_offset + p.width for p in partials})
    if all(p.col_offset in cuts and cuts[cuts.index(p.col_offset) + 1] == p.col_offset + p.width
           for p in partials):
        return partials
    pieces = []
    for part in partials:
        inner = [c for c in cuts if part.col_offset <= c <= part.col_offset + part.width]
        for lo, hi in zip(inner, inner[1:]):
            start = lo - part.col_offset
            pieces.append(PartialBags(part.sums[:, start:start + hi - lo], part.counts, lo))
    return pieces


def _byte_rows(rows: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view [rows, row bytes] of a 2-D CPU tensor whose rows are contiguous.

    The routed path scatters and gathers rows with numpy, on this thread: torch's index kernels over a few
    hundred rows run as OpenMP regions whose idle threads then spin for a while, taking the other core from
    the gRPC threads and the ranks (512 ids over gRPC: 2.3-2.6 -> 1.9-2.3 ms, client CPU 3.1 -> 1.4 ms).
    """
    return rows.view(torch.uint8).numpy()


def _gather_rows(rows: torch.Tensor, order: np.ndarray) -> torch.Tensor:
    """rows[order] for a 2-D CPU tensor, with numpy (see _byte_rows); `order` is in range by construction."""
    if not order.size or not rows.shape[1]:
        return rows.new_empty((order.size, rows.shape[1]))
    return torch.from_numpy(_byte_rows(rows).take(order, axis=0)).view(rows.dtype)


def _answer_bytes(item: _Item) -> int:
    """The data bytes of an item's answer, as a rank counts them against its LookupSmall limit: its rows, or a
    pooled item's per-bag sums in the accumulation dtype."""
    if item.message.pooled:
        return _bags(item) * item.width * accumulation_dtype(item.view.dtype).itemsize
    return item.ids.numel() * item.width * item.view.dtype.itemsize


def _reply_bytes(items: list[_Item]) -> int:
    """An upper bound of a serialized LookupReply answering `items`: their data, a pooled item's int64 counts,
    and each LookupChunk's fields and framing."""
    return sum(_answer_bytes(item) + (_bags(item) * 8 if item.message.pooled else 0) + _CHUNK_FRAMING_BYTES
               for item in items)


def _bags(item: _Item) -> int:
    return len(item.message.offsets) // 8


class _Receiver:
    """Collects the streamed chunks of every item into preallocated tensors and checks versions."""

    def __init__(self, items: list[_Item], where: str) -> None:
        self.items = items
        self.where = where
        self.buffers: list[bytearray | memoryview | None] = [None] * len(items)
        self.received = [0] * len(items)
        self.headers: list[RawLookupChunk | None] = [None] * len(items)
        self.reply: bytearray | None = None  # a whole LookupReply taken off the bulk port, decoded by finish()

    def add(self, chunk: RawLookupChunk) -> None:
        index = chunk.item
        if not 0 <= index < len(self.items):
            raise ShardServeError(f"{self.where} answered item {index} of a {len(self.items)}-item lookup")
        if chunk.offset == 0 and self.headers[index] is None:
            item = self.items[index]
            if chunk.version != item.message.version:
                raise StaleVersionError(f"{self.where} served {item.message.name!r} at version {chunk.version}, "
                                        f"not {item.message.version}", grpc.StatusCode.FAILED_PRECONDITION)
            self.headers[index] = chunk
            if len(chunk.data) == chunk.nbytes and not chunk.data.readonly:
                self.buffers[index] = chunk.data  # the whole item in one writable message: used where it is
                self.received[index] = chunk.nbytes
                return
            self.buffers[index] = bytearray(chunk.nbytes)
        buffer = self.buffers[index]
        end = chunk.offset + len(chunk.data)
        if buffer is None or chunk.offset != self.received[index] or end > len(buffer):
            raise ShardServeError(f"{self.where} sent a misplaced chunk for item {index}")
        buffer[chunk.offset:end] = chunk.data
        self.received[index] = end

    def finish(self) -> None:
        """Give every item its answer (the chunks added, or the bulk reply), checked whole."""
        if self.reply is not None:
            for chunk in decode_lookup_reply(self.reply):
                self.add(chunk)
            self.reply = None
        for index, item in enumerate(self.items):
            header, buffer = self.headers[index], self.buffers[index]
            if header is None or buffer is None or self.received[index] != len(buffer):
                raise ShardServeError(f"{self.where} did not answer item {index} ({item.message.name!r}) whole")
            dtype = dtype_from_wire(header.dtype)
            data = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
            data = data.view(-1, item.width)
            if item.message.pooled:
                counts = torch.frombuffer(bytearray(header.counts), dtype=torch.int64) if header.counts \
                    else torch.empty(0, dtype=torch.int64)
                start = item.columns.start or 0
                item.answer = PartialBags(data, counts, start)
            else:
                item.answer = data


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")


def _bag_request(ids: torch.Tensor, offsets: torch.Tensor, mode: str,
                 weights: torch.Tensor | None) -> BagRequest:
    """Check bag arguments the way nn.EmbeddingBag does; errors name the argument."""
    if mode not in ("sum", "mean"):
        raise InvalidArgumentError(f"mode must be 'sum' or 'mean', got {mode!r}")
    if offsets.numel():
        if int(offsets[0]) != 0:
            raise InvalidArgumentError(f"offsets[0] has to be 0, got {int(offsets[0])}")
        if bool((torch.diff(offsets) < 0).any()) or int(offsets[-1]) > ids.numel():
            raise InvalidArgumentError(f"offsets must be non-decreasing and at most len(ids)={ids.numel()}")
    if weights is not None:
        if mode != "sum":
            raise InvalidArgumentError(f"per_sample_weights is only supported for mode='sum', got mode={mode!r}")
        if not isinstance(weights, torch.Tensor) or weights.shape != (ids.numel(),):
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise InvalidArgumentError(f"per_sample_weights must have shape ({ids.numel()},), got {shape}")
        weights = dense_tensor(weights, "per_sample_weights").detach().cpu().contiguous()
    return BagRequest(ids, offsets, mode, weights)


def validate_update(view: TableView, ids: Any, values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids and their rows for update_rows: duplicates keep the LAST value given (as assignment)."""
    ids = as_ids(ids)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    dense_tensor(values, "values")
    if not torch.can_cast(values.dtype, view.dtype):
        raise TypeError(f"values has dtype {values.dtype}, which table {view.name!r} ({view.dtype}) cannot hold "
                        f"without losing its kind (torch.can_cast)")
    if values.shape != (ids.numel(), view.dim):
        raise InvalidArgumentError(f"values has shape {tuple(values.shape)}; expected ({ids.numel()}, {view.dim})")
    try:
        validate_ids(ids, view.summary.metadata.size[0], "error")
    except ValueError as err:
        raise InvalidArgumentError(f"ids: {err}") from None
    unique, inverse = unique_ids(ids)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(ids.numel(), dtype=torch.int64), reduce="amax")
    return unique, values.detach().cpu().to(view.dtype)[last].contiguous()


def table_options(oov: str, default_row: Any, shape: Sequence[int], dtype: torch.dtype) -> pb.TensorOptions:
    """TensorOptions for create/put: oov "error" (default), "zero" or "default" (needs default_row)."""
    policies = {name: number for number, name in _OOV_NAMES.items()}
    if oov not in policies:
        raise InvalidArgumentError(f"oov must be one of {sorted(policies)}, got {oov!r}")
    if oov != "default":
        if default_row is not None:
            raise InvalidArgumentError(f"default_row is only used with oov='default', got oov={oov!r}")
        return pb.TensorOptions(oov=policies[oov])
    if len(shape) != 2:
        raise InvalidArgumentError(f"oov='default' needs a 2-D table, got shape {tuple(shape)}")
    if not isinstance(default_row, torch.Tensor) or tuple(default_row.shape) != (shape[1],):
        got = tuple(default_row.shape) if isinstance(default_row, torch.Tensor) else type(default_row).__name__
        raise InvalidArgumentError(f"default_row must be a tensor of shape ({shape[1]},), got {got}")
    dense_tensor(default_row, "default_row")
    if not torch.can_cast(default_row.dtype, dtype):
        raise TypeError(f"default_row has dtype {default_row.dtype}, which a {dtype} table cannot hold without "
                        f"losing its kind (torch.can_cast)")
    row = default_row.detach().cpu().to(dtype).contiguous()
    return pb.TensorOptions(oov=pb.OOV_DEFAULT, default_row=bytes(tensor_bytes(row)))
