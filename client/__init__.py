"""shardserve client: connect() to a cluster, put/create tensors, read them through RemoteShardedTensor."""
from client.cluster import Cluster, connect
from client.counters import metrics, serve_metrics
from client.nn import RemoteEmbedding, RemoteEmbeddingBag
from client.errors import (AbortedError, AuthenticationError, DeadlineExceededError, InvalidArgumentError,
                           RankUnavailableError, ResourceExhaustedError, ShardServeError, ShardsLostError,
                           StaleVersionError, TensorExistsError, TensorNotFoundError)
from client.info import RankStatus, RepairProgress, TensorSummary
from client.ops.reshard import ReshardRefusedError
from client.paths.bulk import BulkReadError
from client.paths.shm import SharedMemoryError
from client.tensor import RemoteShard, RemoteShardedTensor

__all__ = [
    "connect", "Cluster", "RemoteShardedTensor", "RemoteShard", "RankStatus", "RepairProgress", "TensorSummary",
    "ShardServeError", "TensorNotFoundError", "InvalidArgumentError", "TensorExistsError",
    "StaleVersionError", "ResourceExhaustedError", "AuthenticationError", "RankUnavailableError",
    "DeadlineExceededError", "AbortedError", "ShardsLostError", "ReshardRefusedError", "SharedMemoryError",
    "BulkReadError",
    "RemoteEmbedding", "RemoteEmbeddingBag", "metrics", "serve_metrics",
]
