"""RankSupervisor on stand-in processes (a sleeping Python, no torch): restarts with backoff, --max-restarts,
stop() racing a pending restart; and the pure parts (backoff, rank lists, `node` argument checks)."""

from __future__ import annotations

import logging
import os
import signal
import sys

import pytest
from waiting import wait_until

from shardserve.server.node import parse_args as parse_node_args
from shardserve.server.node import parse_rank_list
from shardserve.server.supervisor import RankLaunch, RankSupervisor, RestartPolicy, exit_reason

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
WAIT_S = 20.0


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def sleepers(*ranks: int) -> list[RankLaunch]:
    return [RankLaunch(rank, SLEEPER, dict(os.environ)) for rank in ranks]


def kill(supervisor: RankSupervisor, rank: int) -> int:
    proc = supervisor.process(rank)
    proc.kill()
    proc.wait(timeout=WAIT_S)
    return proc.pid


def test_the_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    policy = RestartPolicy(
        max_restarts=10, initial_backoff=1.0, max_backoff=30.0, stable_after=60.0
    )
    waits, previous = [], None
    for _ in range(7):
        previous = policy.next_backoff(previous, uptime=2.0)
        waits.append(previous)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.next_backoff(30.0, uptime=60.0) == 1.0
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(initial_backoff=5.0, max_backoff=1.0)


def test_rank_lists_parse_ranges_and_lists_and_name_what_is_wrong():
    assert parse_rank_list("0-3", 4) == [0, 1, 2, 3]
    assert parse_rank_list("5,0,2", 8) == [0, 2, 5]
    assert parse_rank_list("0-1, 4", 8) == [0, 1, 4]
    for text, message in [
        ("0-4", "rank 4 is not below --world-size 4"),
        ("3-1", "'3-1' is not a range"),
        ("a", "'a' is not a rank"),
        ("", "'' is not a rank"),
        ("-1", "is not a rank"),
        ("0-2,2", r"names ranks \[2\] more than once"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_rank_list(text, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ranks", "0-3", "--world-size", "2"], "rank 3 is not below --world-size 2"),
        (["--ranks", "0", "--world-size", "0"], "--world-size must be >= 1"),
        (
            ["--ranks", "0", "--world-size", "1", "--max-restarts", "-1"],
            "--max-restarts must be >= 0",
        ),
        (
            ["--ranks", "0", "--world-size", "1", "--restart-backoff", "-1"],
            "--restart-backoff must be",
        ),
        (
            ["--ranks", "0", "--world-size", "1", "--coordinator", "nohost"],
            "is not of the form HOST:PORT",
        ),
    ],
)
def test_node_arguments_are_checked_with_the_flag_named(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_COORDINATOR", raising=False)
    if "--coordinator" not in argv:
        argv = [*argv, "--coordinator", "127.0.0.1:50051"]
    with pytest.raises(SystemExit) as exit_:
        parse_node_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_node_needs_a_coordinator(capsys, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_COORDINATOR", raising=False)
    with pytest.raises(SystemExit):
        parse_node_args(["--ranks", "0", "--world-size", "1"])
    assert "--coordinator HOST:PORT is required" in capsys.readouterr().err
    monkeypatch.setenv("SHARDSERVE_COORDINATOR", "10.0.0.1:7000")
    args, ranks = parse_node_args(["--ranks", "0,1", "--world-size", "2"])
    assert args.coordinator == "10.0.0.1:7000" and ranks == [0, 1] and args.max_restarts == 10


def test_exit_reasons_name_the_code_or_the_signal():
    assert exit_reason(3) == "exited with code 3"
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"


def test_a_killed_rank_is_restarted_until_its_restarts_run_out(caplog):
    exits: list[tuple[int, str]] = []
    supervisor = RankSupervisor(
        sleepers(0, 1),
        RestartPolicy(max_restarts=1, initial_backoff=0.0),
        on_exit=lambda rank, reason: exits.append((rank, reason)),
    )
    caplog.set_level(logging.WARNING, logger="shardserve.server.supervisor")
    try:
        supervisor.spawn_all()
        supervisor.watch()
        first = kill(supervisor, 1)
        wait_until(lambda: supervisor.restarts(1) == 1, WAIT_S, "rank 1 to be restarted")
        second = supervisor.process(1).pid
        assert second != first and supervisor.process(1).poll() is None
        assert exits == [(1, f"process {first} was killed by SIGKILL")]
        kill(supervisor, 1)
        wait_until(lambda: supervisor.stays_dead(1), WAIT_S, "rank 1's second death to be final")
        assert supervisor.restarts(1) == 1 and supervisor.pids()[1] == second
        assert exits[-1] == (1, f"process {second} was killed by SIGKILL")
        assert supervisor.restarts(0) == 0 and supervisor.process(0).poll() is None
        messages = [r.getMessage() for r in caplog.records]
        assert any("restarting it in 0.0s (restart 1 of 1)" in m for m in messages)
        assert any(
            "no restarts left (1 of --max-restarts 1 used): it stays dead" in m for m in messages
        )
    finally:
        supervisor.stop(grace=1.0)
    assert all(gone(pid) for pid in supervisor.pids())


def test_max_restarts_zero_leaves_a_dead_rank_dead():
    supervisor = RankSupervisor(sleepers(3), RestartPolicy(max_restarts=0))
    try:
        supervisor.spawn_all()
        supervisor.watch()
        pid = kill(supervisor, 3)
        wait_until(lambda: supervisor.stays_dead(3), WAIT_S, "rank 3 to be declared dead")
        assert supervisor.restarts(3) == 0 and supervisor.pids() == [pid]
    finally:
        supervisor.stop(grace=1.0)


def test_no_rank_is_spawned_once_stop_began():
    """A restart is due in 1 s when stop() begins: it never happens (the watch thread has ended when stop()
    returns, so nothing can spawn later), and every process is gone."""
    supervisor = RankSupervisor(sleepers(0, 1), RestartPolicy(max_restarts=5, initial_backoff=1.0))
    try:
        supervisor.spawn_all()
        supervisor.watch()
        pid = kill(supervisor, 0)
        wait_until(
            lambda: supervisor.restart_pending(0), WAIT_S, "rank 0's restart to be scheduled"
        )
    finally:
        supervisor.stop(grace=1.0)
    assert not supervisor.watching
    assert supervisor.restarts(0) == 0 and supervisor.pids()[0] == pid
    assert all(gone(p) for p in supervisor.pids())
