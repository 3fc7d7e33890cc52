"""SIGINT/SIGTERM as an exception in the main thread, for the foreground commands (up, coordinator, node), or
relayed to a callback on a thread of its own (a rank); SIGHUP as "re-read the tokens file", and SIGUSR1 as
"print every thread's stack" (every server process)."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
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


def relay_stop_signals(on_stop: Callable[[], object]) -> None:
    """From now on SIGINT and SIGTERM call `on_stop` once, on a thread of its own.

    A Python signal handler runs in the main thread between two bytecodes, possibly while that thread holds a
    lock `on_stop` takes: `threading.Event.set` from a handler deadlocks when the signal lands inside the main
    thread's own `Event.wait` (which holds the event's lock around its sleep), and the process then ignores
    every later SIGTERM. So the handler only writes a byte to a pipe (no lock), and a daemon thread that reads
    the pipe calls `on_stop`."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)

    def note_signal(signum: int, frame: object) -> None:
        try:
            os.write(write_end, b"\0")
        except BlockingIOError:  # bytes are already waiting: the stop is on its way
            pass

    def relay() -> None:
        os.read(read_end, 1)
        on_stop()

    threading.Thread(target=relay, name="stop-signal", daemon=True).start()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, note_signal)


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
