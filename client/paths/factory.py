"""The one factory of a client's data paths: every DataPath (client.paths.kinds), the fastest first.

The order is the one transport="auto" tries them in (client.paths.chain): shared memory on the same host
(client.paths.shm), the rank's bulk TCP port (client.paths.bulk), gRPC (client.paths.grpc), which serves every
rank with an address and so comes last. Everything else about a path the policy learns from its Capabilities.
"""

from __future__ import annotations

from shardserve.client.channel import Channel
from shardserve.client.paths.bulk import BulkPath
from shardserve.client.paths.grpc import GrpcPath
from shardserve.client.paths.kinds import DataPath
from shardserve.client.paths.shm import SharedMemoryPath


def data_paths(channel: Channel | None) -> tuple[DataPath, ...]:
    """Every data path of a client over `channel` (None: paths that are planned with, never called), the
    fastest first."""
    return (
        SharedMemoryPath(channel),  # type: ignore[arg-type]
        BulkPath(channel),  # type: ignore[arg-type]
        GrpcPath(channel),  # type: ignore[arg-type]
    )
