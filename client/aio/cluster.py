"""shardserve.aio.connect() and AsyncCluster: the blocking client's objects with awaitable methods, for
inference servers on asyncio (docs/asyncio-client.md).

The catalog's calls (ranks, list, tensor, delete, snapshots) go to the coordinator on grpc.aio. Puts, reads,
lookups and state dicts are the blocking client's own operations (the same checks, retries, data paths and
errors), each run off the event loop on a bounded pool (client.aio.offload) under the deadline the blocking
client gives that work, so the loop never blocks on a copy, a mapping or a socket.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardserve.client import arguments, spmd
from shardserve.client import catalog_requests as catalog
from shardserve.client.aio.coordinator import AioCoordinator
from shardserve.client.aio.nn import AsyncEmbeddingBag
from shardserve.client.aio.offload import OFFLOAD_THREADS, Offload
from shardserve.client.aio.session import AioSession, nbytes_of
from shardserve.client.aio.snapshots import AsyncSnapshot
from shardserve.client.aio.tensor import AsyncRemoteTensor
from shardserve.client.cluster import Cluster
from shardserve.client.cluster import connect as blocking_connect
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.nn import RemoteEmbeddingBag
from shardserve.client.ops.snapshots import SnapshotSummary, snapshot_request, snapshots_listed

CONNECT_SLACK_S = (
    1.0  # connect's await outlasts the blocking connect's own deadline, which then cleans up
)


async def connect(
    address: str,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    threads: int = OFFLOAD_THREADS,
    **options: Any,
) -> AsyncCluster:
    """Connect to the coordinator at HOST:PORT (or to whichever of several, "A,B", leads), as
    shardserve.connect() does (same arguments, same errors);
    `options` are connect()'s others (row_cache_bytes, row_cache_max_age, transport, hedge_after, tracing).

    `timeout` is every awaitable's deadline, plus time for the bytes it moves (as the blocking client bounds
    its calls). `threads`: operations run off the event loop at once (more wait their turn, within their
    deadline).
    """
    timeout = arguments.seconds(timeout, "timeout")
    offload = Offload(arguments.count(threads, "threads", minimum=1))
    try:
        blocking = await offload.run(
            lambda: blocking_connect(
                address,
                token=token,
                timeout=timeout,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                **options,
            ),
            deadline=timeout + CONNECT_SLACK_S,
            what=f"connect to {address}",
        )
    except BaseException:
        offload.close()
        raise
    session = blocking.session
    coordinator = AioCoordinator(
        session.coordinators.addresses, session.channel.credentials, timeout
    )
    return AsyncCluster(AioSession(blocking, coordinator, offload))


class AsyncCluster:
    """A connection to one shardserve cluster with awaitable methods; `async with` it or `await close()`.

    `blocking` is the blocking Cluster it shares its data paths, lookups and health leases with (for calls
    made from other threads)."""

    def __init__(self, session: AioSession) -> None:
        self._session = session
        self.address = session.blocking.address

    @property
    def blocking(self) -> Cluster:
        return self._session.blocking

    async def close(self) -> None:
        """Close the channels (grpc.aio and blocking), mappings, bulk connections and the pool."""
        await self._session.close()

    async def __aenter__(self) -> AsyncCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncCluster(address={self.address!r})"

    # ------------------------------------------------------------ the catalog, on grpc.aio

    async def ranks(self) -> builtins.list[RankStatus]:
        """Every registered rank (address, device, alive, memory), sorted by rank."""
        reply = await self._session.coordinator.call("ListRanks", catalog.list_ranks_request())
        return catalog.ranks_listed(reply)

    async def list(self, include_pending: bool = False) -> builtins.list[TensorSummary]:
        """The catalog: every READY tensor (and PENDING ones when asked), sorted by name."""
        request = catalog.list_tensors_request(include_pending)
        reply = await self._session.coordinator.call("ListTensors", request)
        return catalog.tensors_listed(reply, include_pending)

    async def tensor(self, name: str) -> AsyncRemoteTensor:
        """A proxy of the READY tensor `name` (TensorNotFoundError if there is none)."""
        summary = await self._session.summary(arguments.tensor_name(name))
        return AsyncRemoteTensor(self._session, summary)

    async def delete(self, name: str) -> None:
        """Remove `name` from the catalog and free its shards (TensorNotFoundError if unknown)."""
        await self._session.coordinator.call("DeleteTensor", catalog.delete_tensor_request(name))
        self.blocking.lookups.views.forget(name)

    async def snapshot(self, prefix: str, number: int | None = None) -> AsyncSnapshot:
        """Committed snapshot `number` of `prefix` (None: the newest): its tensors, every one at that snapshot."""
        reply = await self._session.coordinator.call(
            "GetSnapshot", snapshot_request(prefix, number)
        )
        return AsyncSnapshot(self._session, SnapshotSummary.from_proto(reply))

    async def snapshots(self, prefix: str) -> builtins.list[SnapshotSummary]:
        """The kept snapshots of `prefix`, oldest first: number, tensors, bytes, age."""
        request = catalog.list_snapshots_request(prefix)
        return snapshots_listed(await self._session.coordinator.call("ListSnapshots", request))

    # ------------------------------------------------------------ writes and reads, off the loop

    async def put(
        self, name: str, tensor: torch.Tensor, spec: Any = None, **options: Any
    ) -> AsyncRemoteTensor:
        """Cluster.put(name, tensor, spec, **options) off the loop: every shard written, then committed; nothing
        is visible on failure. `options`: overwrite, chunk_bytes, oov, default_row, replicas, durable, dtype,
        delta, reserve_next."""
        proxy = await self._session.run(
            lambda: self.blocking.put(name, tensor, spec, **options),
            f"put of {name!r}",
            nbytes=nbytes_of(tensor),
            calls=2,
        )
        return AsyncRemoteTensor(self._session, proxy.summary)

    async def lookup(
        self, requests: dict[str, Any], dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Rows of several 2-D tables, {name: ids} -> {name: Tensor[len(ids), dim]}, one round trip per rank."""
        return await self._session.run(
            lambda: self.blocking.lookup(requests, dtype), "lookup of several tables"
        )

    async def embedding_bag(
        self,
        name: str,
        mode: str = "mean",
        *,
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> AsyncEmbeddingBag:
        """An awaitable nn.EmbeddingBag over table `name` (RemoteEmbeddingBag's arguments and checks)."""
        bag = await self._session.run(
            lambda: RemoteEmbeddingBag(self.blocking, name, mode, dtype, pooling),
            f"table {name!r}",
        )
        return AsyncEmbeddingBag(self._session, bag)

    # ------------------------------------------------------------ state dicts of a world of one (client.spmd)

    async def put_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str, spec: Any = None, **options: Any
    ) -> int:
        """spmd.put_state_dict(cluster, state_dict, prefix, spec, **options) for this process alone, off the
        loop: every tensor committed as one snapshot of `prefix`; returns its number. `options`: replicas, keep,
        durable, reserve_next, dtype, delta."""
        _check_world_of_one()
        return await self._session.run(
            lambda: spmd.put_state_dict(self.blocking, state_dict, prefix, spec, **options),
            f"put of state dict {prefix!r}",
            nbytes=_tree_bytes(state_dict),
            calls=2,
        )

    async def get_state_dict(
        self, prefix: str, into: Mapping[str, Any], snapshot: int | None = None
    ) -> int:
        """spmd.get_state_dict(cluster, prefix, into, snapshot) for this process alone, off the loop: every
        tensor of `into` filled in place from one snapshot of `prefix`; returns its number."""
        _check_world_of_one()
        return await self._session.run(
            lambda: spmd.get_state_dict(self.blocking, prefix, into, snapshot),
            f"get of state dict {prefix!r}",
            nbytes=_tree_bytes(into),
            calls=2,
        )


def _check_world_of_one() -> None:
    """InvalidArgumentError inside an SPMD job of several processes: its state dicts are collective
    (shardserve.spmd), which an event loop's calls cannot be."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidArgumentError(
            "the asyncio client's state dicts are a world of one, but torch.distributed runs a job of "
            f"{dist.get_world_size()} processes: call shardserve.spmd's on every rank instead"
        )


def _tree_bytes(tree: Any) -> int:
    """The bytes of the tensors in a state dict (nested dicts, lists and tuples too)."""
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, Mapping):
        return sum(_tree_bytes(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tree_bytes(value) for value in tree)
    return 0
