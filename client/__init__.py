"""shardserve client: connect() to a cluster, put/create tensors, read them through RemoteShardedTensor.

Public names are imported from their modules on first use (PEP 562), so that a command that needs none of them
(`shardserve --help`, the server commands the CLI hands over to) starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

_HOME = {
    "spmd": "shardserve.client.spmd",
    "Cluster": "shardserve.client.cluster",
    "connect": "shardserve.client.cluster",
    "metrics": "shardserve.client.counters",
    "serve_metrics": "shardserve.client.counters",
    "AbortedError": "shardserve.client.errors",
    "AuthenticationError": "shardserve.client.errors",
    "DeadlineExceededError": "shardserve.client.errors",
    "DiskFullError": "shardserve.client.errors",
    "EpochEndedError": "shardserve.client.errors",
    "InvalidArgumentError": "shardserve.client.errors",
    "InvalidStateError": "shardserve.client.errors",
    "JobFailedError": "shardserve.client.errors",
    "MemoryLimitError": "shardserve.client.errors",
    "NotLeaderError": "shardserve.client.errors",
    "OverloadedError": "shardserve.client.errors",
    "PermissionDeniedError": "shardserve.client.errors",
    "PreconditionError": "shardserve.client.errors",
    "QuotaExceededError": "shardserve.client.errors",
    "RankUnavailableError": "shardserve.client.errors",
    "RequestTooLargeError": "shardserve.client.errors",
    "ResourceExhaustedError": "shardserve.client.errors",
    "ShardServeError": "shardserve.client.errors",
    "ShardsLostError": "shardserve.client.errors",
    "StaleVersionError": "shardserve.client.errors",
    "TensorBusyError": "shardserve.client.errors",
    "TensorExistsError": "shardserve.client.errors",
    "TensorNotFoundError": "shardserve.client.errors",
    "UnauthenticatedError": "shardserve.client.errors",
    "WorldMismatchError": "shardserve.client.errors",
    "WriteIncompleteError": "shardserve.client.errors",
    "RankStatus": "shardserve.client.info",
    "RepairProgress": "shardserve.client.info",
    "TensorSummary": "shardserve.client.info",
    "RemoteEmbedding": "shardserve.client.nn",
    "RemoteEmbeddingBag": "shardserve.client.nn",
    "ReshardRefusedError": "shardserve.client.ops.reshard",
    "BulkReadError": "shardserve.client.paths.bulk",
    "SharedMemoryError": "shardserve.client.paths.shm",
    "RemoteShard": "shardserve.client.tensor",
    "RemoteShardedTensor": "shardserve.client.tensor",
}
"""The module each public name is imported from on first use (spmd: the module itself)."""

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


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept here (PEP 562)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value
