"""Group commit of row updates: the updates of one table, from any number of clients, share the pending version
that is collecting, write in the order they joined it, and are committed together.

A table has at most one update group at a time. The first `CreateTensor(INIT_COPY)` claims it and makes the
version; one that arrives while that version is collecting joins it instead of making another: it gets the same
version and the next order number, and its CreateTensor answers once every earlier member has finished writing
(its turn), so writes of one version never run at once and a row written by a later member wins on every
replica. A member's CommitTensor ends its turn; the last member's, with no one left to write, closes the group
and promotes the version, and every member's CommitTensor answers with it. What a failure does: a member whose
turn lasts longer than `turn_timeout_s` (its client is gone) has the version aborted by the next member that
waits; an aborted, overtaken or deleted version answers ABORTED to every member, and the clients make their
updates again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from shardserve.server.common.errors import JobFailed, ServiceError, TensorBusy

if TYPE_CHECKING:
    from shardserve.protos import shardserve_pb2 as pb

R = TypeVar("R")

CLAIM_WAIT_S = 1.0  # how long an update waits for a group it cannot join (being made, or committing): then ABORTED
UPDATE_TURN_S = 30.0  # a member writing this long (its client is gone) has the version aborted by a waiting member
MAX_MEMBERS = 16  # updates joined into one version; the next ones wait for the following version
WAKE_S = 0.5  # how often a waiting member looks for a stalled turn


@dataclass(frozen=True)
class Ordered(Generic[R]):
    """A version as one caller sees it: `value` (the version made or committed), the caller's place in the
    version's update group (`update_order`; 0 outside a group), and the shards its ranks opened for the caller's
    in-place writes (`writable`: their answers, relayed to the writer as they are)."""

    value: R
    update_order: int = 0
    writable: Sequence[pb.WritableShard] = ()


@dataclass
class _Group(Generic[R]):
    """The pending update version of one table and its members (member 0 made it)."""

    since: float  # when the current turn began (the claim, until the version is bound)
    version: int = 0  # 0 while member 0 is making it
    members: int = 1  # joined so far
    turn: int = 0  # the member writing now: the ones before it have finished
    closed: bool = False  # its commit has begun: no one joins any more
    tokens: set[str] = field(default_factory=set)  # put_tokens of the members' CreateTensor calls
    outcome: R | None = None  # the committed version, once promoted
    error: ServiceError | None = None  # why it ended uncommitted


class UpdateGroups(Generic[R]):
    """The update group of every table being updated, behind one condition variable; a group's commit
    answers an R (the committed version) to every member."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        claim_wait_s: float = CLAIM_WAIT_S,
        turn_timeout_s: float = UPDATE_TURN_S,
        max_members: int = MAX_MEMBERS,
    ) -> None:
        self._clock = clock
        self._claim_wait_s = claim_wait_s
        self._turn_timeout_s = turn_timeout_s
        self._max_members = max_members
        self._groups: dict[str, _Group[R]] = {}
        self._changed = threading.Condition()

    def enter(
        self, name: str, token: str, abort: Callable[[str, int], None], join: bool = True
    ) -> tuple[int, int] | None:
        """Join the collecting version of `name` (unless not `join`): (its version, this member's order) once it
        is this member's turn to write; or claim a new group: None, and the caller makes the version and calls
        `bind` (or `cancel`). ABORTED when a group that cannot be joined keeps the table longer than the claim
        wait, or when the version fails before this member's turn."""
        give_up = self._clock() + self._claim_wait_s
        with self._changed:
            while True:
                group = self._groups.get(name)
                if group is None:
                    self._groups[name] = _Group(since=self._clock(), tokens={token})
                    return None
                if (
                    join
                    and group.version
                    and not group.closed
                    and group.members < self._max_members
                ):
                    return group.version, self._join(name, group, token, abort)
                left = give_up - self._clock()
                if left <= 0:
                    raise TensorBusy(
                        f"tensor {name!r} has an update being made or committed (version "
                        f"{group.version}); ask again"
                    )
                self._wait(name, group, abort, left)

    def bind(self, name: str, version: int) -> None:
        """Member 0 of `name`'s group made pending `version`: its turn to write begins, others may join."""
        with self._changed:
            group = self._groups[name]
            group.version, group.since = version, self._clock()
            self._changed.notify_all()

    def cancel(self, name: str) -> None:
        """Member 0 of `name`'s group failed to make its version: free the table for the next update."""
        with self._changed:
            group = self._groups.get(name)
            if group is not None and not group.version:
                del self._groups[name]
                self._changed.notify_all()

    def finish(
        self,
        name: str,
        version: int,
        commit: Callable[[], R],
        abort: Callable[[str, int], None],
    ) -> Ordered[R]:
        """The member writing `version` of `name` has written: pass the turn on, and commit the version (by
        `commit`) when it was the last member; every member answers with the committed version and its own
        order. A version no group holds is simply committed."""
        with self._changed:
            group = self._groups.get(name)
            if group is None or group.version != version:
                group = None
            else:
                order = group.turn
                group.turn += 1
                group.since = self._clock()
                last = group.closed = group.turn == group.members
                self._changed.notify_all()
        if group is None:
            return Ordered(commit())
        if last:
            self._commit(name, group, commit)
        with self._changed:
            while group.outcome is None and group.error is None:
                self._wait(name, group, abort, WAKE_S)
        if group.error is not None:
            raise group.error
        assert group.outcome is not None
        return Ordered(group.outcome, order)

    def end(self, name: str, version: int | None = None) -> None:
        """`version` of `name` was aborted, discarded or deleted (None: whatever version, for a delete): its
        members that wait are answered ABORTED."""
        with self._changed:
            group = self._groups.get(name)
            if (
                group is not None
                and group.version
                and (version is None or group.version == version)
            ):
                self._fail(
                    name,
                    group,
                    TensorBusy(
                        f"update version {group.version} of tensor {name!r} was aborted "
                        f"before its commit (a member failed, or a reshard, load or "
                        f"delete replaced it); make the update again"
                    ),
                )

    def version_of_token(self, name: str, token: str) -> int:
        """The pending version of `name` a member joined with put_token `token`, or 0."""
        with self._changed:
            group = self._groups.get(name)
            return group.version if group is not None and token in group.tokens else 0

    def _join(
        self, name: str, group: _Group[R], token: str, abort: Callable[[str, int], None]
    ) -> int:
        """(condition held) Add a member to `group` and wait for its turn; its order."""
        order = group.members
        group.members += 1
        group.tokens.add(token)
        while group.turn < order and group.error is None:
            self._wait(name, group, abort, WAKE_S)
        if group.error is not None:
            raise group.error
        return order

    def _commit(self, name: str, group: _Group[R], commit: Callable[[], R]) -> None:
        """Promote the closed `group`'s version and hand every member the outcome."""
        try:
            outcome = commit()
        except BaseException as err:
            failure = (
                err
                if isinstance(err, ServiceError)
                else JobFailed(
                    f"update version {group.version} of tensor {name!r} failed to commit: {err}"
                )
            )
            with self._changed:
                self._fail(name, group, failure)
            raise
        with self._changed:
            group.outcome = outcome
            if self._groups.get(name) is group:
                del self._groups[name]
            self._changed.notify_all()

    def _wait(
        self, name: str, group: _Group[R], abort: Callable[[str, int], None], wait_s: float
    ) -> None:
        """(condition held) Wait up to `wait_s` for a change; abort `group`'s version when its turn stalled."""
        stalled = (
            group.version
            and group.outcome is None
            and group.error is None
            and not (group.closed and group.turn == group.members)
            and self._clock() - group.since > self._turn_timeout_s
        )
        if not stalled:
            self._changed.wait(min(wait_s, WAKE_S))
            return
        version = group.version
        self._fail(
            name,
            group,
            TensorBusy(
                f"update version {version} of tensor {name!r} was aborted: member "
                f"{group.turn} did not finish writing within {self._turn_timeout_s:g} s "
                f"(its client is gone); make the update again"
            ),
        )
        self._changed.release()
        try:
            abort(name, version)
        finally:
            self._changed.acquire()

    def _fail(self, name: str, group: _Group[R], error: ServiceError) -> None:
        """(condition held) End `group` uncommitted with `error` for its waiting members."""
        if group.error is None and group.outcome is None:
            group.error = error
        if self._groups.get(name) is group:
            del self._groups[name]
        self._changed.notify_all()
