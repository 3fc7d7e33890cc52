"""Cluster.load_checkpoint / save_checkpoint: DCP checkpoints read and written by the ranks themselves.

The client only names things: it asks the coordinator what the checkpoint
holds (InspectCheckpoint), builds each tensor's layout from `spec` (default:
row-wise over every live rank), and streams LoadCheckpoint / SaveCheckpoint
progress. The data never passes through the client: every rank reads or
writes its own shards in the checkpoint directory, which must be on a
filesystem the ranks and the coordinator see (paths are made absolute here).
A load is all or nothing: either every tensor appears READY, or none does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from shardserve.client import arguments
from shardserve.client.errors import InvalidArgumentError, ShardServeError, TensorNotFoundError
from shardserve.client.info import TensorSummary
from shardserve.client.session import Session
from shardserve.core.dtypes import dtype_from_name, dtype_from_wire
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb

Progress = Callable[[int, int], None]
_DEFAULT_TIMEOUT_S = 600.0


def _path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(f"path must be a non-empty path, got {path!r}")
    return os.path.abspath(os.fspath(path))


def inspect_checkpoint(
    session: Session, path: Any
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{tensor name: (size, dtype)} of the DCP checkpoint at `path`, as the coordinator reads it."""
    reply = session.call("InspectCheckpoint", pb.InspectCheckpointRequest(path=_path(path)))
    return {t.name: (tuple(t.size), dtype_from_wire(t.dtype)) for t in reply.tensors}


def _names(names: list[str] | None, available: Sequence[str], path: str) -> list[str]:
    if names is None:
        return sorted(available)
    if not names:
        raise InvalidArgumentError(
            "names is empty: give None to load every tensor of the checkpoint"
        )
    unknown = [n for n in names if n not in available]
    if unknown:
        raise TensorNotFoundError(
            f"names {unknown} are not in checkpoint {path} (it holds {sorted(available)})",
            grpc.StatusCode.NOT_FOUND,
        )
    return names


def load_checkpoint(
    session: Session,
    path: Any,
    names: Sequence[str] | str | None = None,
    *,
    spec: Any = None,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    timeout: float = _DEFAULT_TIMEOUT_S,
    replicas: int = 1,
) -> list[TensorSummary]:
    """Load tensors of a DCP checkpoint into the cluster, each rank reading its own shards (every copy of a box
    when `replicas` > 1); all or none appear. Returns the loaded tensors' catalog entries."""
    timeout = arguments.seconds(timeout, "timeout")
    replicas = arguments.count(replicas, "replicas", minimum=1)
    overwrite = arguments.flag(overwrite, "overwrite")
    arguments.callback(progress, "progress")
    names = arguments.name_list(names)
    path = _path(path)
    saved = inspect_checkpoint(session, path)
    chosen = _names(names, list(saved), path)
    if isinstance(spec, Mapping) and set(spec) - set(chosen):
        raise InvalidArgumentError(
            f"spec names {sorted(set(spec) - set(chosen))}, which are not among the tensors "
            f"loaded {chosen}"
        )
    tensors = []
    for name in chosen:
        size, saved_dtype = saved[name]
        layout_spec = spec.get(name) if isinstance(spec, Mapping) else spec
        try:
            want = saved_dtype if dtype is None else dtype_from_name(dtype)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(f"dtype: {err}") from None
        meta = session.layouts.layout(size, want, layout_spec, replicas)
        tensors.append(pb.CheckpointTensor(name=name, metadata=metadata_to_proto(meta)))
    request = pb.LoadCheckpointRequest(
        path=path, tensors=tensors, overwrite=overwrite, timeout_s=timeout
    )
    final = _follow(session, "LoadCheckpoint", request, progress, timeout)
    return [TensorSummary.from_proto(info) for info in final.tensors]


def save_checkpoint(
    session: Session,
    path: Any,
    names: Sequence[str] | str | None = None,
    progress: Progress | None = None,
    timeout: float = _DEFAULT_TIMEOUT_S,
) -> list[str]:
    """Write READY tensors (every one by default: names=None) as one DCP checkpoint at `path`; returns their
    names. The checkpoint already at `path` is replaced only once every rank wrote its part."""
    timeout = arguments.seconds(timeout, "timeout")
    arguments.callback(progress, "progress")
    names = arguments.name_list(names)
    if names == []:
        raise InvalidArgumentError("names is empty (leave it None to save every tensor)")
    request = pb.SaveCheckpointRequest(path=_path(path), names=names or [], timeout_s=timeout)
    final = _follow(session, "SaveCheckpoint", request, progress, timeout)
    return [info.name for info in final.tensors]


def _follow(
    session: Session, method: str, request: Any, progress: Progress | None, timeout: float
) -> pb.CheckpointProgress:
    """The checkpoint job's progress stream, each report passed to `progress`; returns its final message."""

    def report(message: pb.CheckpointProgress) -> None:
        if progress is not None:
            progress(message.bytes_done, message.bytes_total)

    done = [message for message in session.follow(method, request, timeout, report) if message.done]
    if not done:
        raise ShardServeError(
            f"the coordinator at {session.address} ended the stream without a result"
        )
    return done[-1]
