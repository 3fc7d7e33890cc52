"""The asyncio client: `await shardserve.aio.connect(address)` gives the blocking client's objects with awaitable
methods (docs/asyncio-client.md); the exceptions are the blocking client's (shardserve.client.errors)."""

from shardserve.client.aio.cluster import AsyncCluster, connect
from shardserve.client.aio.nn import AsyncEmbeddingBag
from shardserve.client.aio.snapshots import AsyncSnapshot
from shardserve.client.aio.tensor import AsyncRemoteTensor

__all__ = ["connect", "AsyncCluster", "AsyncRemoteTensor", "AsyncSnapshot", "AsyncEmbeddingBag"]
