"""SIGINT/SIGTERM as an exception in the main thread, for the foreground commands (up, coordinator, node), and
SIGHUP as "re-read the tokens file"."""

from __future__ import annotations

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
    """From now on SIGINT and SIGTERM raise Stop in the main thread (once; later ones are ignored)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_stop)


def wait_for_stop_signal() -> None:
    """Block until SIGINT/SIGTERM raises Stop."""
    handle_stop_signals()
    while True:
        time.sleep(0.2)  # short sleeps: a signal landing on a non-main thread is handled promptly


def handle_reload_signal(reload: Callable[[], object]) -> None:
    """From now on SIGHUP calls `reload` (in the main thread): token rotation without a restart."""
    signal.signal(signal.SIGHUP, lambda signum, frame: reload())
