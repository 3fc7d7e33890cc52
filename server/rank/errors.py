"""The rank's own errors: what went wrong in its store, memory, shards or data paths, with no word of the
transport.

Every raise on the rank is one of these, and each class is named after the `Reason` it answers with
(shardserve.protos.errors: TensorNotFound for TENSOR_NOT_FOUND, ...), the same name the coordinator's
service errors (server/common/errors.py) and the docs use for that cause. The servicers turn them into gRPC
statuses through one table (server/rank/error_status.py). `metadata` names the tensor, rank or field an
error is about, where known.
"""

from __future__ import annotations

from collections.abc import Mapping


class RankError(Exception):
    """A refusal by the rank's logic; the message names the bad field or the state that forbids the call."""

    def __init__(self, message: str, *, metadata: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.metadata: dict[str, object] = dict(metadata or {})

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgument(RankError):
    """A request field is malformed, or names something the tensor does not have: a shard, a box, a dtype or
    size that do not fit."""


class TensorNotFound(RankError):
    """No version of the tensor is held on this rank."""


class StaleVersion(RankError):
    """The version asked for is not held, or not served, here (any more, or yet): the caller refreshes."""


class InvalidState(RankError):
    """The version is not in the state the call needs: committed already, allocated already, reserved for a
    collective job, shared with an older version (rows only), or asked for a step its state machine forbids."""


class WriteIncomplete(RankError):
    """Some local shards of the version are not fully written, or a change left them torn."""


class TensorBusy(RankError):
    """Another writer holds the shard, or the version was dropped before its allocation arrived."""


class MemoryLimit(RankError):
    """The rank's memory limit, or its device's memory, has no room for the bytes asked for."""


class DiskFull(RankError):
    """The rank could not persist for want of space; nothing was acknowledged."""


class RequestTooLarge(RankError):
    """The request is over what one call may ask for (bytes, ids, regions)."""


class Overloaded(RankError):
    """Too many concurrent calls or connections: retry later."""


class PermissionDenied(RankError):
    """The caller may not read or write that tensor, or hold that memory."""


class RankUnavailable(RankError):
    """This rank cannot do the work now (its disk failed, a peer of a job is unreachable): retryable."""


class EpochEnded(RankError):
    """A collective job's epoch ended (a participant failed or a newer epoch began): run the job again."""


class PathUnavailable(RankError):
    """A data path (shared memory, in-place writes, the bulk port) is not offered for this call: the client
    falls back to another."""
