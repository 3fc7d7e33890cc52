"""server.rank_start: a `python -m shardserve.server` command forked from the forkserver answers the Popen calls
the supervisor makes as a spawned one does (pid, poll, wait with its timeout, signals, exit codes), gets the
environment and folder it was started with, and any other command is a plain new process; a supervisor
restarts a killed forked rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from shardserve.server.rank_start import (
    ForkedProcess,
    forkserver_context,
    server_args,
    start_process,
)
from shardserve.server.supervisor import RankLaunch, RankSupervisor, RestartPolicy

WAIT_S = 60.0  # the first fork waits for the forkserver to import torch


def server(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardserve.server", *args]


def coordinator_args(tmp_path: Path) -> list[str]:
    """A long-running shardserve.server command that needs no other process; it writes `address` once it
    serves."""
    return [
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(tmp_path / "state"),
        "--address-file",
        str(tmp_path / "address"),
    ]


def serving(tmp_path: Path) -> None:
    wait_until(lambda: (tmp_path / "address").exists(), WAIT_S, "the coordinator to serve")


def test_only_shardserve_server_commands_have_server_args():
    assert server_args(server("--coordinator", "h:1")) == ["--coordinator", "h:1"]
    assert server_args(["python3", "-m", "shardserve.server"]) is None  # another interpreter
    assert server_args([sys.executable, "-c", "pass"]) is None
    with pytest.raises(
        ValueError, match="start method must be one of forkserver, spawn, got 'fork'"
    ):
        start_process(server(), dict(os.environ), "fork")
    with pytest.raises(ValueError, match="start_method must be one of"):
        RankSupervisor([], start_method="exec")


def test_a_forked_server_answers_like_popen_and_reports_its_kill(tmp_path):
    env = dict(os.environ, RANK="7")
    proc = start_process(server(*coordinator_args(tmp_path)), env, "forkserver")
    try:
        assert isinstance(proc, ForkedProcess)
        serving(tmp_path)
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "shardserve-r7"
        assert proc.poll() is None and proc.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        assert (
            os.getppid() != proc.pid and _parent_of(proc.pid) != os.getpid()
        )  # the forkserver's child
    finally:
        proc.kill()
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL == proc.returncode


def test_a_forked_server_stops_on_sigterm_with_its_own_exit_code(tmp_path):
    proc = start_process(server(*coordinator_args(tmp_path)), dict(os.environ), "forkserver")
    serving(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0


def test_a_forked_server_gets_the_launchers_environment_and_folder(tmp_path, monkeypatch):
    """A relative --state-dir lands in the folder the launcher was in, and a bad flag is exit code 2 (usage)."""
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, SHARDSERVE_COORDINATOR="nohost")
    proc = start_process(server("--world-size", "1", "--rank", "0"), env, "forkserver")
    assert proc.wait(timeout=WAIT_S) == 2  # the coordinator address from its environment is refused
    relative = start_process(
        server("coordinator", "--listen", "127.0.0.1:0", "--state-dir", "here"), env, "forkserver"
    )
    try:
        wait_until(lambda: (tmp_path / "here" / "catalog.sqlite").exists(), WAIT_S, "its catalog")
    finally:
        relative.kill()
        relative.wait(timeout=WAIT_S)


def test_other_commands_start_as_new_processes():
    proc = start_process(
        [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), "forkserver"
    )
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=WAIT_S) == 3


def test_a_killed_forked_rank_is_restarted(tmp_path):
    launch = RankLaunch(0, server(*coordinator_args(tmp_path)), dict(os.environ))
    supervisor = RankSupervisor(
        [launch], RestartPolicy(max_restarts=1, initial_backoff=0.0), start_method="forkserver"
    )
    supervisor.spawn_all()
    supervisor.watch()
    try:
        first = supervisor.process(0)
        serving(tmp_path)
        first.kill()
        wait_until(lambda: supervisor.restarts(0) == 1, WAIT_S, "the restart")
        second = supervisor.process(0)
        assert second.pid != first.pid and first.returncode == -signal.SIGKILL
        assert second.poll() is None
    finally:
        supervisor.stop()
    assert supervisor.process(0).poll() is not None


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_server_stops_when_its_forkserver_is_killed(tmp_path):
    """kill -9 of the forkserver (which reports the ranks' exits) ends its ranks too, so that a supervisor that
    sees them gone never starts a second process of a rank that still runs."""
    command = server(*coordinator_args(tmp_path))
    script = (
        "import os, sys, time\n"
        "from shardserve.server.rank_start import start_process\n"
        f"proc = start_process({command!r}, dict(os.environ), 'forkserver')\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        serving(tmp_path)
        forkserver = _parent_of(pid)
        assert forkserver != launcher.pid
        os.kill(forkserver, signal.SIGKILL)
        wait_until(lambda: not _running(pid), WAIT_S, "the forked server to stop")
    finally:
        launcher.kill()
        launcher.wait(timeout=WAIT_S)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_server_appends_its_output_to_the_file_it_was_given(tmp_path):
    """What the server prints (here argparse's usage error, exit 2) lands after what the file held."""
    output = tmp_path / "log.txt"
    output.write_text("before\n")
    proc = ForkedProcess(["coordinator", "--no-such-flag"], dict(os.environ), output=str(output))
    assert proc.wait(timeout=WAIT_S) == 2
    text = output.read_text()
    assert text.startswith("before\n") and "unrecognized arguments: --no-such-flag" in text


def test_sigusr1_prints_every_threads_stack_and_the_server_serves_on(tmp_path):
    """A server asked with SIGUSR1 writes each thread's stack to its output (faulthandler) and keeps running;
    SIGTERM then stops it cleanly."""
    output, address = tmp_path / "log.txt", tmp_path / "address"
    args = ["coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    proc = ForkedProcess(
        [*args, "--address-file", str(address)], dict(os.environ), output=str(output)
    )
    try:
        wait_until(address.exists, WAIT_S, "the coordinator to serve")
        proc.send_signal(signal.SIGUSR1)
        marks = (
            "Current thread 0x",
            "Thread 0x",
            "(most recent call first)",
            "in wait_for_stop_signal",
        )
        wait_until(
            lambda: all(mark in output.read_text() for mark in marks),
            WAIT_S,
            "every thread's stack",
        )
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0


def _report_heap(answers) -> None:  # type: ignore[no-untyped-def]
    """In a forked process: what it inherited frozen, and what its first full collection walks."""
    import gc

    answers.put((gc.get_freeze_count(), len(gc.get_objects())))


def test_a_forked_process_inherits_the_forkservers_heap_frozen():
    """The forkserver freezes its heap (torch, the rank's modules) before it forks: a forked process's
    collections walk only what it made itself, not the ~200,000 objects it inherited."""
    context = forkserver_context()
    answers = context.Queue()
    process = context.Process(target=_report_heap, args=(answers,))
    process.start()
    frozen, tracked = answers.get(timeout=WAIT_S)
    process.join(timeout=WAIT_S)
    assert process.exitcode == 0
    assert frozen > 100_000 and tracked < frozen // 10, (frozen, tracked)
