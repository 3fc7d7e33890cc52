"""How a launcher starts a rank process: forked from a process that imported the rank's code once, or a new
interpreter each time.

A rank's start is mostly Python importing torch (2-3 s of CPU), paid again at every restart. With the start
method `forkserver` (the default of `shardserve up` and `node`) the launcher keeps one server process,
multiprocessing's forkserver started on the first rank, that imported torch and the rank's modules once, and
each rank is forked from it and runs `python -m shardserve.server ARGS`' main with its own environment: a
rank (re)starts in a fraction of a second. Forking is safe there: that process never made a thread pool, a
gRPC channel or a CUDA context (each rank makes its own after the fork), as with DataLoader workers. As with
any multiprocessing forkserver, each child first imports the launcher's main module (as `__mp_main__`): a
script that starts a LocalCluster with it must keep its work under `if __name__ == "__main__":`. With
`spawn` (LocalCluster's default) each rank is a new interpreter (`python -m shardserve.server ARGS`), as
torchrun starts its workers.

Either way the supervisor sees the Popen calls it uses (pid, poll, wait, send_signal, kill, returncode); a
forked rank is a child of the forkserver, which reports its exit: it watches the launcher's pid, not its
parent's, to stop when the launcher is gone, and is sent SIGTERM when the forkserver ends (which it does when
the launcher is gone, or if it is killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Protocol

START_METHODS = ("forkserver", "spawn")
CLI_START_METHOD = "forkserver"
"""The default of `up` and `node`, whose main module (shardserve's own) is safe to import in every rank."""
SERVER_MODULE = "shardserve.server"
PRELOAD = ["torch", "shardserve.server.rank.main"]
"""What the forkserver imports once, before it forks any rank."""
FROZEN_HEAP = "shardserve.server.common.frozen_heap"
"""Imported after everything else the forkserver preloads: its heap frozen before the first fork."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class StartedProcess(Protocol):
    """The calls of subprocess.Popen a supervisor makes on a rank's process."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def server_args(command: Sequence[str]) -> list[str] | None:
    """The ARGS of a `python -m shardserve.server ARGS` command line, None for any other command."""
    if (
        len(command) >= 3
        and command[0] == sys.executable
        and list(command[1:3]) == ["-m", SERVER_MODULE]
    ):
        return list(command[3:])
    return None


def start_process(command: Sequence[str], env: dict[str, str], method: str) -> StartedProcess:
    """Start `command` with environment `env`: a `python -m shardserve.server` command forked from the
    forkserver when `method` is "forkserver", anything else as a new process."""
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {', '.join(START_METHODS)}, got {method!r}")
    args = server_args(command)
    if method == "forkserver" and args is not None:
        return ForkedProcess(args, env)
    return subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL)


def forkserver_context(
    also_preload: Sequence[str] = (),
) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server preloaded with PRELOAD, then `also_preload`, then
    FROZEN_HEAP: the one every forked rank comes from, and which tests and benchmarks start their worker
    processes from too (none imports torch again). The list is read when the server starts: once it runs,
    another list takes effect only if it is restarted."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *also_preload, FROZEN_HEAP])
    return context


class ForkedProcess:
    """A `python -m shardserve.server ARGS` process forked from the forkserver, with Popen's calls; `output`, a
    file its stdout and stderr are appended to (None: the forkserver's)."""

    def __init__(
        self, args: Sequence[str], env: dict[str, str], *, output: str | None = None
    ) -> None:
        self._process = forkserver_context().Process(
            target=run_server,
            args=(list(args), dict(env), os.getcwd(), output),
            name="shardserve-rank",
            daemon=True,
        )
        self._process.start()
        # the exit status is read once from a pipe that the forkserver writes: one reader at a time
        self._lock = threading.Lock()
        self.pid: int = self._process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        """The exit code (-N: killed by signal N), None while it runs."""
        with self._lock:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it ended; subprocess.TimeoutExpired when it still runs after `timeout` s."""
        with self._lock:
            self._process.join(timeout)
            code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"{SERVER_MODULE} (pid {self.pid})", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_server(args: list[str], env: dict[str, str], cwd: str, output: str | None = None) -> None:
    """In the forked process: become `python -m shardserve.server ARGS` with environment `env`, in the folder
    the launcher was in when it started this rank (the forkserver's is the one of its own start), writing to
    the end of file `output` if given."""
    _stop_with_parent()
    if output is not None:
        write_output_to(output)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _name_process(f"shardserve-r{env.get('RANK', '')}")
    sys.argv = [SERVER_MODULE, *args]
    threads = env.get("OMP_NUM_THREADS", "")  # torch read it at its import, before this environment
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)  # as `python -m` runs it


def write_output_to(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2, and Python's streams over them) appended to
    the file at `path`: a forked server's or test worker's output kept in its log."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _name_process(name: str) -> None:
    """Show `name` as this process's name (ps -o comm, top; 15 characters), not the forkserver's."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])


def _stop_with_parent() -> None:
    """SIGTERM this process when the forkserver ends (prctl PR_SET_PDEATHSIG), as when its launcher is gone:
    a rank must not outlive the process that reports its exit, or its launcher would start a second one."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
