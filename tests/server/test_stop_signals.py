"""A rank's SIGTERM/SIGINT relayed off the signal handler (server/common/stop_signals.py): a handler runs in the
main thread between two bytecodes, maybe while that thread holds the very lock the stop needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import signal, threading
    from shardserve.server.common.stop_signals import relay_stop_signals

    lock, stopped = threading.Lock(), threading.Event()

    def on_stop():
        if lock.acquire(timeout=5):  # the lock the main thread holds while the signal lands
            lock.release()
            stopped.set()

    relay_stop_signals(on_stop)
    with lock:
        signal.raise_signal(signal.{name})  # its handler runs here, in this thread, inside the lock
        print("inside", stopped.is_set())
    print("stopped", stopped.wait(5))
    signal.raise_signal(signal.{name})  # a second signal is harmless
    print("alive")
    """
)


def run(name: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(name=name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def test_a_stop_signal_landing_while_the_main_thread_holds_the_stops_lock_stops_it_once_released():
    """Were the callback run by the handler itself (as `signal.signal(SIGTERM, lambda *_: stop.set())` does,
    which deadlocked a rank whose main thread was inside `stop.wait`), it would wait on the main thread's lock
    and never stop: relayed, it runs on its own thread as soon as the main thread lets go."""
    for name in ("SIGTERM", "SIGINT"):
        assert run(name)[:3] == ["inside False", "stopped True", "alive"]
