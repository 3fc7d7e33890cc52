"""shardserve client: connect() to a cluster, put/create tensors, read them through RemoteShardedTensor."""
from client.cluster import Cluster, connect
from client.embedding.modules import RemoteEmbedding, RemoteEmbeddingBag
from client.errors import (AuthenticationError, DeadlineExceededError, InvalidArgumentError,
                           RankUnavailableError, ResourceExhaustedError, ShardServeError,
                           AbortedError, StaleVersionError, TensorExistsError, TensorNotFoundError)
from client.info import RankStatus, TensorSummary
from client.tensor import RemoteShard, RemoteShardedTensor
from client.ops.reshard import ReshardRefusedError
from client.paths.shm import SharedMemoryError
from client.paths.bulk import BulkReadError

__all__ = [
    "connect", "Cluster", "RemoteShardedTensor", "RemoteShard", "RankStatus", "TensorSummary",
    "ShardServeError", "TensorNotFoundError", "InvalidArgumentError", "TensorExistsError",
    "StaleVersionError", "ResourceExhaustedError", "AuthenticationError", "RankUnavailableError",
    "DeadlineExceededError", "AbortedError", "ReshardRefusedError", "SharedMemoryError", "BulkReadError",
    "RemoteEmbedding", "RemoteEmbeddingBag",
]
