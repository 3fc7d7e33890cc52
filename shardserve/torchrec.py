"""TorchRec models served by a shardserve cluster (needs the extra: `pip install shardserve[torchrec]`).

    from shardserve import connect
    from shardserve.torchrec import RemoteEmbeddingBagCollection
    remote = RemoteEmbeddingBagCollection.from_module(connect(address), ebc, "ranker")
    pooled = remote(kjt)    # a KeyedTensor, as ebc(kjt) gives it

docs/embedding-serving.md#torchrec says what is served and how.
"""

from shardserve.client.torchrec import (
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    table_name,
)

__all__ = ["RemoteEmbeddingBagCollection", "RemoteEmbeddingCollection", "table_name"]
