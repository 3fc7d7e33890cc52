"""connect() and Cluster: the client's handle on a shardserve cluster (coordinator + ranks).

Cluster creates, puts, lists and deletes tensors through the coordinator and
hands out RemoteShardedTensor proxies for reading. A put is all-or-nothing: the
tensor is created PENDING, every shard streamed to its owner, then committed;
any failure aborts the pending version so no half tensor is ever visible.
"""
from __future__ import annotations

import contextlib
import numbers
import threading
import uuid
from functools import partial
from typing import Any, Callable, Sequence

import grpc
import torch

from client import arguments
from client.ops import checkpoints
from client.errors import (AbortedError, DeadlineExceededError, InvalidArgumentError, RankUnavailableError,
                           ShardServeError, StaleVersionError, TensorNotFoundError)
from client.info import RankStatus, TensorSummary
from client.embedding.lookup import Lookups, table_options
from client.embedding.row_cache import CacheStats, RowCache
from client.ops.row_updates import update_rows
from client.tensor import RemoteShardedTensor
from client.paths.policy import DataPlane, check_transport
from client.paths.shm import SharedMemoryReader
from client.paths.bulk import BulkConnections
from client.channel import CHUNK_BYTES, MAX_CHUNK_BYTES, Credentials, Transport, check_address
from protos import shardserve_pb2 as pb
from shardcore.dtypes import dtype_from_name, dtype_to_wire
from shardcore.interop import as_spec
from shardcore.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardcore.regions import cut_tensor
from shardcore.specs import ChunkShardingSpec, EnumerableShardingSpec, tensor_size
from shardcore.validation import validate_metadata
from shardcore.wire import metadata_to_proto, tensor_bytes

INIT_KINDS = {"zeros": pb.INIT_ZEROS, "ones": pb.INIT_ONES, "normal": pb.INIT_NORMAL, "arange": pb.INIT_ARANGE}


def connect(address: str, token: str | None = None, timeout: float = 30.0, tls_ca: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None, row_cache_bytes: int = 0,
            row_cache_max_age: float = 1.0, transport: str = "auto") -> "Cluster":
    """Connect to the coordinator at HOST:PORT; fails fast if it cannot be reached or refuses the token.

    `row_cache_bytes` > 0 keeps an LRU cache of embedding rows of that many bytes (see client.embedding.row_cache);
    cached rows are used for at most `row_cache_max_age` seconds before the table's version is checked again.
    `transport` picks the data path of reads (client.paths.policy): "auto" (shared memory for ranks on this
    host, else the ranks' bulk TCP port for parts over 1 MiB without TLS, else gRPC; each falling back to the
    next when it fails), or one path forced: "grpc", "shm" or "tcp" (an error when a rank cannot be read that way).
    """
    check_address(address)
    check_transport(transport)
    timeout = arguments.seconds(timeout, "timeout")
    row_cache_max_age = arguments.seconds(row_cache_max_age, "row_cache_max_age", allow_zero=True)
    cache = RowCache(arguments.count(row_cache_bytes, "row_cache_bytes")) if row_cache_bytes else None
    cluster = Cluster(address, Transport(Credentials(token, tls_ca, tls_cert, tls_key), timeout), cache)
    cluster._lookups.cache_max_age = row_cache_max_age
    cluster._data_plane = DataPlane(transport, cluster._data_plane.reader, cluster._transport.credentials.uses_tls)
    try:
        cluster._refresh_ranks()
    except RankUnavailableError as err:
        cluster.close()
        raise RankUnavailableError(f"{err}{_tls_hint(str(err), tls_ca, tls_cert)}", err.code) from None
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
        return (" (if the cluster wants client certificates (mutual TLS), pass tls_cert and tls_key; if it serves "
                "plaintext, pass no tls_ca)")
    return " (if the cluster serves plaintext, pass no tls_ca/tls_cert/tls_key)"


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


class Cluster:
    """A connection to one shardserve cluster; use as a context manager or call close()."""

    def __init__(self, address: str, transport: Transport, row_cache: RowCache | None = None) -> None:
        self.address = address
        self._transport = transport
        self._coordinator = transport.coordinator(address)
        self._ranks: dict[int, RankStatus] = {}
        self._ranks_lock = threading.Lock()
        self._lookups = Lookups(self, row_cache)
        self._bulk = BulkConnections(transport)
        self._data_plane = DataPlane("auto", SharedMemoryReader(
            transport.shard_server, transport.credentials.metadata(), transport.timeout, transport.submit),
            transport.credentials.uses_tls)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every channel, bulk connection, shared-memory mapping (unmapped once no tensor uses it) and
        the read pool."""
        self._bulk.close()
        self._data_plane.reader.clear()
        self._transport.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster(address={self.address!r}, ranks={sorted(self._ranks)})"

    # ------------------------------------------------------------ coordinator calls

    def _call(self, method: str, request: Any) -> Any:
        return self._transport.unary(getattr(self._coordinator, method), request, f"coordinator at {self.address}")

    def _refresh_ranks(self) -> list[RankStatus]:
        ranks = [RankStatus.from_proto(r) for r in self._call("ListRanks", pb.ListRanksRequest()).ranks]
        with self._ranks_lock:
            self._ranks = {r.rank: r for r in ranks}
        return ranks

    def _address_of(self, rank: int) -> str:
        return self._rank_status(rank).address

    def _rank_status(self, rank: int) -> RankStatus:
        """The registered status of `rank` (address, host, shared memory), refreshed once if unknown."""
        status = self._ranks.get(rank)
        if status is None or not status.address:
            status = {r.rank: r for r in self._refresh_ranks()}.get(rank)
        if status is None or not status.address:
            raise RankUnavailableError(f"rank {rank} is not registered with the coordinator at {self.address}")
        return status

    def _get_summary(self, name: str) -> TensorSummary:
        return TensorSummary.from_proto(self._call("GetTensor", pb.GetTensorRequest(name=arguments.tensor_name(name))))

    def ranks(self) -> list[RankStatus]:
        """Every registered rank (address, device, alive, memory), sorted by rank."""
        return sorted(self._refresh_ranks(), key=lambda r: r.rank)

    def list(self, include_pending: bool = False) -> list[TensorSummary]:
        """The catalog: every READY tensor (and PENDING ones when asked), sorted by name."""
        include_pending = arguments.flag(include_pending, "include_pending")
        reply = self._call("ListTensors", pb.ListTensorsRequest(include_pending=include_pending))
        tensors = [TensorSummary.from_proto(t) for t in reply.tensors]
        return sorted((t for t in tensors if include_pending or t.state == "READY"), key=lambda t: t.name)

    def tensor(self, name: str) -> RemoteShardedTensor:
        """A proxy of the READY tensor `name` (TensorNotFoundError if there is none)."""
        return RemoteShardedTensor(self, self._get_summary(name))

    def __getitem__(self, name: str) -> RemoteShardedTensor:
        return self.tensor(name)

    def __contains__(self, name: str) -> bool:
        return any(t.name == name for t in self.list())

    def delete(self, name: str) -> None:
        """Remove `name` from the catalog and free its shards (TensorNotFoundError if unknown)."""
        self._call("DeleteTensor", pb.DeleteTensorRequest(name=arguments.tensor_name(name)))
        self._lookups.forget(name)

    # ------------------------------------------------------------ creating tensors

    def _metadata(self, shape: Sequence[int], dtype: torch.dtype, spec: Any) -> ShardedTensorMetadata:
        """The layout of a tensor of `shape`/`dtype` under `spec` (default: row-wise over every live rank; a 0-d
        tensor whole on the first live rank)."""
        if spec is None:
            live = [r for r in self.ranks() if r.alive]
            if not live:
                raise RankUnavailableError(f"no live rank is registered with the coordinator at {self.address}")
            placements = [f"rank:{r.rank}/{r.device}" for r in live]
            spec = ChunkShardingSpec(0, placements) if len(shape) else \
                EnumerableShardingSpec([ShardMetadata((), (), placements[0])])
        spec = _resolve_spec(spec)
        try:
            if isinstance(spec, ShardedTensorMetadata):
                meta = spec
                if meta.size != tuple(shape) or meta.dtype != dtype:
                    raise ValueError(f"spec metadata is for a {meta.dtype} tensor of size {meta.size}, "
                                     f"not {dtype} of size {tuple(shape)}")
            else:
                meta = spec.build_metadata(tuple(shape), TensorProperties(dtype=dtype))
            validate_metadata(meta)
        except ValueError as err:
            raise InvalidArgumentError(f"spec: {err}") from None
        return meta

    def create(self, name: str, shape: Sequence[int], dtype: torch.dtype | str = torch.float32, spec: Any = None,
               init: str = "zeros", seed: int = 0, overwrite: bool = False, oov: str = "error",
               default_row: torch.Tensor | None = None) -> RemoteShardedTensor:
        """Create a tensor filled on the ranks by `init` ("zeros", "ones", "normal" or "arange").

        `oov` says how embedding lookups answer ids out of range: "error", "zero" or "default" (`default_row`).
        """
        arguments.tensor_name(name)
        if init not in INIT_KINDS:
            raise InvalidArgumentError(f"init must be one of {sorted(INIT_KINDS)}, got {init!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -(1 << 63) <= seed < 1 << 63:
            raise InvalidArgumentError(f"seed must be a 64-bit int, got {seed!r}")
        overwrite = arguments.flag(overwrite, "overwrite")
        try:
            dtype = dtype_from_name(dtype)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"dtype: {err}") from None
        shape = _shape(shape)
        meta = self._metadata(shape, dtype, spec)
        options = table_options(oov, default_row, shape, dtype)
        info = self._create_tensor(pb.CreateTensorRequest(
            name=name, metadata=metadata_to_proto(meta), init=INIT_KINDS[init], seed=int(seed), overwrite=overwrite,
            options=options))
        self._lookups.forget(name)
        return RemoteShardedTensor(self, TensorSummary.from_proto(info))

    def put(self, name: str, tensor: torch.Tensor, spec: Any = None, overwrite: bool = False,
            chunk_bytes: int = CHUNK_BYTES, oov: str = "error",
            default_row: torch.Tensor | None = None) -> RemoteShardedTensor:
        """Cut `tensor` by `spec`, stream every shard to its owner and commit; nothing is visible on failure."""
        arguments.tensor_name(name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        arguments.dense_tensor(tensor, "tensor")
        overwrite = arguments.flag(overwrite, "overwrite")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Integral) or \
                not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgumentError(f"chunk_bytes must be an int in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes!r}")
        try:
            dtype_to_wire(tensor.dtype)
        except ValueError as err:
            raise InvalidArgumentError(f"tensor dtype: {err}") from None
        meta = self._metadata(tuple(tensor.shape), tensor.dtype, spec)
        options = table_options(oov, default_row, tuple(tensor.shape), tensor.dtype)
        source = tensor.detach().cpu()
        shards = cut_tensor(source, meta)
        info = self._create_tensor(pb.CreateTensorRequest(
            name=name, metadata=metadata_to_proto(meta), init=pb.INIT_NONE, overwrite=overwrite, options=options))
        try:
            jobs = [partial(self._write_shard, name, info.version, index, shard, meta, chunk_bytes)
                    for index, shard in enumerate(shards)]
            try:
                self._transport.run_all(jobs)
            except (StaleVersionError, TensorNotFoundError) as err:
                raise self._why_writes_failed(name, info.version, err) from None
            committed = self._commit(name, info.version)
        except BaseException:
            self._abort(name, info.version)
            raise
        self._lookups.forget(name)
        return RemoteShardedTensor(self, TensorSummary.from_proto(committed))

    def _why_writes_failed(self, name: str, version: int, err: ShardServeError) -> ShardServeError:
        """A write told "no such version": AbortedError when the version is gone from the catalog (a concurrent
        put or create of the name with overwrite=True aborted it), else the write's own error."""
        with contextlib.suppress(ShardServeError):
            listed = self._call("ListTensors", pb.ListTensorsRequest(include_pending=True)).tensors
            if not any(t.name == name and t.version == version for t in listed):
                return AbortedError(f"put of {name!r} version {version} was aborted while it wrote: another put "
                                    f"or create of {name!r} with overwrite=True replaced it", grpc.StatusCode.ABORTED)
        return err

    def _write_shard(self, name: str, version: int, index: int, shard: torch.Tensor,
                     meta: ShardedTensorMetadata, chunk_bytes: int) -> int:
        data = tensor_bytes(shard)
        header = pb.WriteShardHeader(name=name, version=version, shard_index=index,
                                     dtype=dtype_to_wire(meta.dtype), nbytes=len(data))
        address = self._address_of(meta.shards_metadata[index].rank)
        return self._transport.write_shard(address, header, data, chunk_bytes)

    def _create_tensor(self, request: pb.CreateTensorRequest) -> pb.TensorInfo:
        """CreateTensor under a fresh put token. When the answer is lost (deadline, connection) the version may
        have been made anyway, with no one to write or abort it: the token aborts it (or, if the coordinator
        has not run the call yet, makes it refuse the call), instead of leaving it to the pending timeout."""
        request.put_token = uuid.uuid4().hex
        try:
            return self._call("CreateTensor", request)
        except (DeadlineExceededError, RankUnavailableError):
            with contextlib.suppress(ShardServeError):
                self._call("AbortTensor", pb.AbortTensorRequest(name=request.name, put_token=request.put_token))
            raise

    def _commit(self, name: str, version: int) -> pb.TensorInfo:
        """CommitTensor of a pending version. When the answer is lost (deadline, connection) the commit may still
        have happened: then the READY version says so, and it counts as done rather than being reported failed
        while it is visible."""
        try:
            return self._call("CommitTensor", pb.CommitTensorRequest(name=name, version=version))
        except (DeadlineExceededError, RankUnavailableError):
            try:
                ready = self._call("GetTensor", pb.GetTensorRequest(name=name))
            except ShardServeError:
                ready = None
            if ready is not None and ready.version == version:
                return ready
            raise

    def _abort(self, name: str, version: int) -> None:
        """Best-effort AbortTensor of a pending version (the coordinator also times pending ones out)."""
        with contextlib.suppress(ShardServeError):
            self._call("AbortTensor", pb.AbortTensorRequest(name=name, version=version))

    # ------------------------------------------------------------ embedding serving (client.embedding.lookup)

    def lookup(self, requests: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Rows of several 2-D tables, {name: ids} -> {name: Tensor[len(ids), dim]}, one round trip per rank."""
        if not isinstance(requests, dict):
            raise TypeError(f"requests must be a dict of table name -> ids, got {type(requests).__name__}")
        for name in requests:
            arguments.tensor_name(name)
        return self._lookups.lookup(requests, dtype)

    def update_rows(self, name: str, ids: Any, values: torch.Tensor) -> int:
        """Replace rows of a 2-D table in a new version, atomically (see client.ops.row_updates); returns it."""
        return update_rows(self, arguments.tensor_name(name), ids, values)

    def row_cache_stats(self) -> CacheStats | None:
        """Hits, misses and size of the row cache (None when connect() got no row_cache_bytes)."""
        cache = self._lookups.cache
        return cache.stats() if cache is not None else None

    # ------------------------------------------------------------ DCP checkpoints (client.ops.checkpoints)

    def load_checkpoint(self, path: str, names: Sequence[str] | str | None = None, spec: Any = None,
                        dtype: torch.dtype | str | None = None, overwrite: bool = False,
                        progress: Callable[[int, int], None] | None = None,
                        timeout: float = 600.0) -> dict[str, RemoteShardedTensor]:
        """Load tensors of the DCP checkpoint at `path` (every rank reads its own shards); all appear or none.

        `spec` (one for all, or {name: spec}) lays them out (default: row-wise over every live rank);
        `progress(bytes_done, bytes_total)` is called as the ranks report.
        """
        return checkpoints.load_checkpoint(self, path, names, spec, dtype, overwrite, progress, timeout)

    def save_checkpoint(self, path: str, names: Sequence[str] | str | None = None,
                        progress: Callable[[int, int], None] | None = None, timeout: float = 600.0) -> list[str]:
        """Write READY tensors (all by default) as one DCP checkpoint at `path`; torch's dcp.load reads it."""
        return checkpoints.save_checkpoint(self, path, names, progress, timeout)

    def inspect_checkpoint(self, path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (size, dtype)} of the tensors of the DCP checkpoint at `path`."""
        return checkpoints.inspect_checkpoint(self, path)


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
