"""shardserve: serve sharded PyTorch tensors over gRPC.

The public API: `connect()` to a cluster, the `spmd` helpers for SPMD jobs, the
`RemoteEmbedding` / `RemoteEmbeddingBag` modules, every client exception and the `Reason` an
exception's `.reason` holds.
The folders of the repository map to import names as `client/` ->
`shardserve.client`, `server/` -> `shardserve.server`, `protos/` ->
`shardserve.protos` and `shardcore/` -> `shardserve.core`.
"""

from shardserve.client import (
    AbortedError,
    AuthenticationError,
    BulkReadError,
    Cluster,
    DeadlineExceededError,
    InvalidArgumentError,
    PermissionDeniedError,
    PreconditionError,
    RankStatus,
    RankUnavailableError,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RemoteShard,
    RemoteShardedTensor,
    RepairProgress,
    ReshardRefusedError,
    ResourceExhaustedError,
    ShardServeError,
    ShardsLostError,
    SharedMemoryError,
    StaleVersionError,
    TensorExistsError,
    TensorNotFoundError,
    TensorSummary,
    connect,
    metrics,
    serve_metrics,
    spmd,
)
from shardserve.protos.errors import Reason

__all__ = [
    "connect",
    "Reason",
    "spmd",
    "Cluster",
    "RemoteShardedTensor",
    "RemoteShard",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "RankStatus",
    "RepairProgress",
    "TensorSummary",
    "metrics",
    "serve_metrics",
    "ShardServeError",
    "TensorNotFoundError",
    "InvalidArgumentError",
    "TensorExistsError",
    "StaleVersionError",
    "ResourceExhaustedError",
    "AuthenticationError",
    "PermissionDeniedError",
    "PreconditionError",
    "RankUnavailableError",
    "DeadlineExceededError",
    "AbortedError",
    "ShardsLostError",
    "ReshardRefusedError",
    "SharedMemoryError",
    "BulkReadError",
]
