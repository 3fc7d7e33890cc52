"""shardserve client: connect() to a cluster, put/create tensors, read them through RemoteShardedTensor."""

from shardserve.client import spmd
from shardserve.client.cluster import Cluster, connect
from shardserve.client.counters import metrics, serve_metrics
from shardserve.client.errors import (
    AbortedError,
    AuthenticationError,
    DeadlineExceededError,
    DiskFullError,
    EpochEndedError,
    InvalidArgumentError,
    InvalidStateError,
    JobFailedError,
    MemoryLimitError,
    NotLeaderError,
    OverloadedError,
    PermissionDeniedError,
    PreconditionError,
    QuotaExceededError,
    RankUnavailableError,
    RequestTooLargeError,
    ResourceExhaustedError,
    ShardServeError,
    ShardsLostError,
    StaleVersionError,
    TensorBusyError,
    TensorExistsError,
    TensorNotFoundError,
    UnauthenticatedError,
    WorldMismatchError,
    WriteIncompleteError,
)
from shardserve.client.info import RankStatus, RepairProgress, TensorSummary
from shardserve.client.nn import RemoteEmbedding, RemoteEmbeddingBag
from shardserve.client.ops.reshard import ReshardRefusedError
from shardserve.client.paths.bulk import BulkReadError
from shardserve.client.paths.shm import SharedMemoryError
from shardserve.client.tensor import RemoteShard, RemoteShardedTensor

__all__ = [
    "connect",
    "spmd",
    "Cluster",
    "RemoteShardedTensor",
    "RemoteShard",
    "RankStatus",
    "RepairProgress",
    "TensorSummary",
    "ShardServeError",
    "TensorNotFoundError",
    "InvalidArgumentError",
    "TensorExistsError",
    "StaleVersionError",
    "ResourceExhaustedError",
    "AuthenticationError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "PreconditionError",
    "RankUnavailableError",
    "DeadlineExceededError",
    "AbortedError",
    "ShardsLostError",
    "DiskFullError",
    "EpochEndedError",
    "InvalidStateError",
    "JobFailedError",
    "MemoryLimitError",
    "NotLeaderError",
    "OverloadedError",
    "QuotaExceededError",
    "RequestTooLargeError",
    "TensorBusyError",
    "WorldMismatchError",
    "WriteIncompleteError",
    "ReshardRefusedError",
    "SharedMemoryError",
    "BulkReadError",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "metrics",
    "serve_metrics",
]
