"""TorchRec models served by the cluster: RemoteEmbeddingBagCollection and RemoteEmbeddingCollection.

The only part of shardserve that imports torchrec (an optional extra: `pip install shardserve[torchrec]`).
"""

try:
    import torchrec  # noqa: F401
except ImportError as err:
    raise ImportError(
        f"shardserve.torchrec needs TorchRec, which did not import ({err}): "
        "pip install shardserve[torchrec]"
    ) from err

from shardserve.client.torchrec.pooled import RemoteEmbeddingBagCollection
from shardserve.client.torchrec.tables import table_name
from shardserve.client.torchrec.unpooled import RemoteEmbeddingCollection

__all__ = ["RemoteEmbeddingBagCollection", "RemoteEmbeddingCollection", "table_name"]
