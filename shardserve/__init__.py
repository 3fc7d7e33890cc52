"""shardserve: serve sharded PyTorch tensors over gRPC.

The public API: `connect()` to a cluster, the `spmd` helpers for SPMD jobs, the
`RemoteEmbedding` / `RemoteEmbeddingBag` modules, every client exception and the `Reason` an
exception's `.reason` holds.
The folders of the repository map to import names as `client/` ->
`shardserve.client`, `server/` -> `shardserve.server`, `protos/` ->
`shardserve.protos` and `shardcore/` -> `shardserve.core`.

The names are imported when first used, not by `import shardserve`: a server process imports
`shardserve.server`, and so this package, and needs nothing of the client (whose import pulls in
torch.distributed and more, seconds of CPU at every rank start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.client import (
        AbortedError,
        AuthenticationError,
        BulkReadError,
        Cluster,
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
        RankStatus,
        RankUnavailableError,
        RemoteEmbedding,
        RemoteEmbeddingBag,
        RemoteShard,
        RemoteShardedTensor,
        RepairProgress,
        RequestTooLargeError,
        ReshardRefusedError,
        ResourceExhaustedError,
        ShardServeError,
        ShardsLostError,
        SharedMemoryError,
        StaleVersionError,
        TensorBusyError,
        TensorExistsError,
        TensorNotFoundError,
        TensorSummary,
        UnauthenticatedError,
        WorldMismatchError,
        WriteIncompleteError,
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
]

_HOME = {name: "shardserve.client" for name in __all__} | {"Reason": "shardserve.protos.errors"}
"""The module each public name is imported from on first use."""


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept here (PEP 562)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
