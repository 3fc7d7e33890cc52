"""The rank's own errors: what went wrong in its store, memory or shards, with no word of the transport.

The store and its parts raise these; the servicers turn them into gRPC statuses and reasons through one table
(server/rank/error_status.py). `metadata` names the tensor, rank or field an error is about, where known.
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


class BadRequest(RankError):
    """The call names something the tensor does not have: a shard, a box, a dtype or size that do not fit."""


class TensorUnknown(RankError):
    """No version of the tensor is held on this rank."""


class VersionNotServed(RankError):
    """The version asked for is not held, or not served, here (any more, or yet)."""


class VersionCommitted(RankError):
    """A served version never changes: the call needs a pending one."""


class VersionExists(RankError):
    """The version is allocated on this rank already."""


class ShardReserved(RankError):
    """The shard's bytes come with a collective job (reshard, checkpoint load), not with a write."""


class RowsOnly(RankError):
    """The shard shares blocks with an older version (a row update's copy): only its rows may change."""


class ShardsIncomplete(RankError):
    """Some local shards of the version are not fully written, or a change left them torn."""


class VersionBusy(RankError):
    """Another writer holds the shard, or the version was dropped before its allocation arrived."""


class OverMemory(RankError):
    """The rank's memory limit, or its device's memory, has no room for the bytes asked for."""


class BoxTooLarge(RankError):
    """The box asked for is over what one request may read."""


class IllegalTransition(RankError):
    """A version was asked to change state in a way its state machine does not allow (a bug, not a request)."""
