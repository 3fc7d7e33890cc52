"""UpdateGroups in-process: updates of one table join the collecting version, write in join order, and are
committed once by the last member; failures answer ABORTED to every member. Threads stand for gRPC workers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures

import pytest

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import TensorBusy
from shardserve.server.coordinator.drivers.update_groups import UpdateGroups

WAIT_S = 30.0  # bound on every wait of a test thread


def _never_abort(name: str, version: int) -> None:
    raise AssertionError(f"no version should be aborted here, got {name!r} {version}")


class _Commits:
    """A commit callable that counts its calls and answers version `version` READY."""

    def __init__(self, version: int) -> None:
        self.version, self.calls = version, 0

    def __call__(self) -> pb.TensorInfo:
        self.calls += 1
        return pb.TensorInfo(name="t", version=self.version, state=pb.READY)


def _pending(pool: futures.ThreadPoolExecutor, call: Callable[[], object]) -> futures.Future:
    """Run `call` on a thread; it must still be waiting shortly after (it waits for a turn or a commit)."""
    future = pool.submit(call)
    with pytest.raises(futures.TimeoutError):
        future.result(timeout=0.2)
    return future


def test_updates_join_the_collecting_version_and_commit_once_in_join_order() -> None:
    groups, commits = UpdateGroups(), _Commits(7)
    assert (
        groups.enter("t", "a", _never_abort) is None
    )  # member 0 claims the table and makes the version
    groups.bind("t", 7)
    with futures.ThreadPoolExecutor(4) as pool:
        second = _pending(
            pool, lambda: groups.enter("t", "b", _never_abort)
        )  # waits for member 0's writes
        first_commit = pool.submit(groups.finish, "t", 7, commits, _never_abort)
        assert second.result(timeout=WAIT_S) == (7, 1)
        third = _pending(
            pool, lambda: groups.enter("t", "c", _never_abort)
        )  # joins while member 1 writes
        assert (
            not first_commit.done() and commits.calls == 0
        )  # committed only once everyone has written
        second_commit = pool.submit(groups.finish, "t", 7, commits, _never_abort)
        assert third.result(timeout=WAIT_S) == (7, 2)
        assert groups.version_of_token("t", "c") == 7
        last = groups.finish("t", 7, commits, _never_abort)
        answers = [first_commit.result(timeout=WAIT_S), second_commit.result(timeout=WAIT_S), last]
    assert commits.calls == 1
    assert [(a.value.version, a.update_order) for a in answers] == [(7, 0), (7, 1), (7, 2)]
    assert groups.enter("t", "d", _never_abort) is None  # the next update makes the next version


def test_a_version_being_made_or_committing_is_not_joined_and_a_full_one_neither() -> None:
    groups = UpdateGroups(claim_wait_s=0.3, max_members=2)
    assert groups.enter("t", "a", _never_abort) is None
    with pytest.raises(TensorBusy, match="update being made or committed"):
        groups.enter("t", "b", _never_abort)  # member 0 is still making the version
    groups.bind("t", 3)
    with pytest.raises(TensorBusy, match="being made or committed"):
        groups.enter("t", "c", _never_abort, join=False)  # a copy of a given version makes its own
    with futures.ThreadPoolExecutor(2) as pool:
        second = _pending(pool, lambda: groups.enter("t", "b", _never_abort))
        with pytest.raises(TensorBusy):
            groups.enter("t", "c", _never_abort)  # two members: full
        first_commit = pool.submit(groups.finish, "t", 3, _Commits(3), _never_abort)
        assert second.result(timeout=WAIT_S) == (3, 1)
        groups.finish("t", 3, _Commits(3), _never_abort)
        first_commit.result(timeout=WAIT_S)
    assert groups.enter("u", "a", _never_abort) is None  # other tables are independent


def test_an_aborted_version_answers_aborted_to_every_waiting_member() -> None:
    groups = UpdateGroups()
    groups.enter("t", "a", _never_abort)
    groups.bind("t", 4)
    with futures.ThreadPoolExecutor(2) as pool:
        joiner = _pending(pool, lambda: groups.enter("t", "b", _never_abort))
        groups.end("t", 4)  # member 0 aborted it (or a reshard, load or delete replaced it)
        with pytest.raises(TensorBusy, match="make the update again"):
            joiner.result(timeout=WAIT_S)
    assert groups.enter("t", "c", _never_abort) is None


def test_a_failed_commit_answers_every_member_with_its_error() -> None:
    groups = UpdateGroups()
    groups.enter("t", "a", _never_abort)
    groups.bind("t", 4)

    def overtaken() -> pb.TensorInfo:
        raise TensorBusy("overtaken by a reshard")

    with futures.ThreadPoolExecutor(2) as pool:
        joiner = _pending(pool, lambda: groups.enter("t", "b", _never_abort))
        first_commit = pool.submit(groups.finish, "t", 4, overtaken, _never_abort)
        assert joiner.result(timeout=WAIT_S) == (4, 1)
        with pytest.raises(TensorBusy, match="overtaken"):
            groups.finish("t", 4, overtaken, _never_abort)
        with pytest.raises(TensorBusy, match="overtaken"):
            first_commit.result(timeout=WAIT_S)


def test_a_member_whose_client_is_gone_has_the_version_aborted_by_the_next_one() -> None:
    now = [0.0]
    aborted: list[tuple[str, int]] = []
    groups = UpdateGroups(clock=lambda: now[0], turn_timeout_s=10.0)
    groups.enter("t", "a", _never_abort)
    groups.bind("t", 9)
    done = threading.Event()
    with futures.ThreadPoolExecutor(1) as pool:
        joiner = _pending(
            pool, lambda: groups.enter("t", "b", lambda n, v: (aborted.append((n, v)), done.set()))
        )
        now[0] = 11.0  # member 0 never finished writing
        assert done.wait(WAIT_S)
        with pytest.raises(TensorBusy, match="did not finish writing"):
            joiner.result(timeout=WAIT_S)
    assert aborted == [("t", 9)]
    assert groups.enter("t", "c", _never_abort) is None


def test_a_version_no_group_holds_is_committed_directly() -> None:
    commits = _Commits(2)
    assert UpdateGroups().finish("t", 2, commits, _never_abort).value.version == 2
    assert commits.calls == 1
