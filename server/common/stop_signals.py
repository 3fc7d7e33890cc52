"""SIGINT/SIGTERM as an exception in the main thread, for the foreground commands (up, coordinator, node),
SIGHUP as "re-read the tokens file", and SIGUSR1 as "print every thread's stack" (every server process)."""

from __future__ import annotations

import faulthandler
import signal
import time
from collections.abc import Callable


class Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM; its message is the signal's name."""


def _raise_stop(signum: int, frame: object) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)  # a second signal must not interrupt the cleanup
    raise Stop(signal.Signals(signum).name)


def handle_stop_signals() -> None:
    """From now on SIGINT and SIGTERM raise Stop in the main thread (once; later ones are ignored), and SIGUSR1
    prints the stacks (handle_dump_signal)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_stop)
    handle_dump_signal()


def handle_dump_signal() -> None:
    """From now on SIGUSR1 writes the stack of every thread to stderr (faulthandler: in C, so it answers while
    the main thread is blocked): what a process that does not stop, or does not answer, is doing."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def wait_for_stop_signal() -> None:
    """Block until SIGINT/SIGTERM raises Stop."""
    handle_stop_signals()
    while True:
        time.sleep(0.2)  # short sleeps: a signal landing on a non-main thread is handled promptly


def handle_reload_signal(reload: Callable[[], object]) -> None:
    """From now on SIGHUP calls `reload` (in the main thread): token rotation without a restart."""
    signal.signal(signal.SIGHUP, lambda signum, frame: reload())
