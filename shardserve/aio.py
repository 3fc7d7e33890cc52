"""The asyncio client, for inference servers on asyncio (docs/asyncio-client.md):

    from shardserve import aio
    async with await aio.connect(address) as cluster:
        table = await cluster.tensor("table")
        rows = await table.lookup(ids)

Every method that talks to the cluster is awaitable and never blocks the event loop; the exceptions are
shardserve's own (TensorNotFoundError, InvalidArgumentError, RankUnavailableError, DeadlineExceededError ...).
"""

from shardserve.client.aio import (
    AsyncCluster,
    AsyncEmbeddingBag,
    AsyncRemoteTensor,
    AsyncSnapshot,
    connect,
)

__all__ = ["connect", "AsyncCluster", "AsyncRemoteTensor", "AsyncSnapshot", "AsyncEmbeddingBag"]
