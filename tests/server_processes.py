"""Server processes for tests that must stop and restart a coordinator: `python -m shardserve.server ...`
spawned (a new interpreter, as users start it) or forked from the preloaded forkserver (torch imported once,
for tests whose subject is not the process start), and wait."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO, Any

from waiting import wait_until

from shardserve.server.common.cli_args import CLUSTER_SECRET_FILE_ENV
from shardserve.server.common.principals import ClusterSecret
from shardserve.server.rank_launch import PROJECT_ROOT
from shardserve.server.rank_start import ForkedProcess, forkserver_context, write_output_to


@functools.cache
def cluster_secret_file() -> str:
    """A cluster secret file shared by the servers this test session spawns (removed at exit)."""
    folder = tempfile.mkdtemp(prefix="shardserve-secret-")
    atexit.register(shutil.rmtree, folder, True)
    return str(ClusterSecret.generate().write(Path(folder) / "cluster-secret").path)


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment with the project importable and a cluster secret file, plus `extra`."""
    return dict(
        os.environ,
        PYTHONPATH=str(PROJECT_ROOT),
        **{CLUSTER_SECRET_FILE_ENV: cluster_secret_file()},
        **extra,
    )


def spawn_server(args: Sequence[str], env: dict[str, str], log: IO) -> subprocess.Popen:
    """`python -m shardserve.server *args` with output to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardserve.server", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def fork_server(args: Sequence[str], env: dict[str, str], log: IO) -> ForkedProcess:
    """`python -m shardserve.server *args` forked from the forkserver (the ranks' own, preloaded with torch),
    with output to the end of `log`'s file."""
    log.flush()
    return ForkedProcess(args, env, output=log.name)


def fork_client(log: Path, main: Callable[..., None], *args: Any) -> BaseProcess:
    """`main(*args)` in a started process forked from the forkserver (torch imported once, not per client), its
    output (fds 1 and 2, a failure's traceback too) in `log`: the clients a test runs beside each other."""
    process = forkserver_context().Process(
        target=_logged, args=(str(log), main, *args), daemon=True
    )
    process.start()
    return process


def _logged(log: str, main: Callable[..., None], *args: Any) -> None:
    write_output_to(log)
    main(*args)


def run_together(processes: Sequence[BaseProcess], folder: Path, timeout: float) -> None:
    """Let `processes` (client K writes FOLDER/ready-K once connected, waits for FOLDER/go, logs to
    FOLDER/log-K.txt) go together once all are connected, and wait for every one to exit 0: else an
    AssertionError with the logs of those that crashed or failed. Any left running is killed."""

    def all_ready() -> bool:
        crashed = [k for k, p in enumerate(processes) if p.exitcode is not None]
        assert not crashed, [_log_tail(folder, k) for k in crashed]
        return len(list(folder.glob("ready-*"))) >= len(processes)

    try:
        wait_until(all_ready, timeout, "every client to connect")
        (folder / "go").touch()
        for process in processes:
            process.join(timeout)
        codes = [p.exitcode for p in processes]
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join(30)
    assert codes == [0] * len(processes), [_log_tail(folder, k) for k, c in enumerate(codes) if c]


def _log_tail(folder: Path, index: int) -> str:
    return (folder / f"log-{index}.txt").read_text()[-2000:]


def start_up(
    args: Sequence[str], state_dir: Path, log: IO, *, timeout: float
) -> tuple[subprocess.Popen, str]:
    """`shardserve up *args` in its own process (as users run it), state under `state_dir`: the process and
    the coordinator's address once it serves (read from --address-file); AssertionError if it ends first."""
    address_file = state_dir / "coordinator.address"
    proc = spawn_server(
        ["up", "--state-dir", str(state_dir), "--address-file", str(address_file), *args],
        server_env(),
        log,
    )
    try:
        wait_until(
            lambda: address_file.exists() or proc.poll() is not None, timeout, "`up` to serve"
        )
        if proc.poll() is not None:
            raise AssertionError(f"`shardserve up` exited with {proc.returncode} before serving")
        return proc, address_file.read_text().strip()
    except BaseException:
        stop_all([proc])
        raise


def rank_env(env: dict[str, str], rank: int, world_size: int) -> dict[str, str]:
    """`env` with torchrun's variables for `rank` of a one-host world."""
    return dict(
        env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def stop_all(procs: Sequence[subprocess.Popen | ForkedProcess]) -> None:
    """SIGTERM every process still running, SIGKILL those not gone after 15 s: first SIGUSR1, so that the stacks
    of what kept it (every thread's) are in its output."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2)  # the stacks written
            proc.kill()
            proc.wait(5)


def pause(proc: subprocess.Popen | ForkedProcess, timeout: float = 10.0) -> None:
    """SIGSTOP `proc` and return once every one of its threads is stopped: the kernel stops a busy process's
    threads only as each is next scheduled (milliseconds on a loaded host), and a test that sends a request
    right after the signal must not see it served."""
    proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: _all_threads_stopped(proc.pid), timeout, f"process {proc.pid} to stop")


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])  # the state follows the parenthesised name
    return bool(states) and all(state in "tT" for state in states)
