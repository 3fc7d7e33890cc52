"""Peak resident memory of processes during a window of time, sampled by a separate sampler process.

VmHWM cannot be reset between scenarios, so a sampler samples VmRSS
(psutil's `memory_info().rss`) of the benchmark process and every descendant
every few milliseconds and keeps the maximum seen inside each open window.
The sampler runs in its own small process (`python -m benchmarks.rss PID`),
not a thread here: a sampling thread would take the GIL from the code being
timed (milliseconds at a time, with Python's 5 ms switch interval).

Protocol on the sampler's stdin/stdout, one line each: `open ID` -> `ok`,
`close ID` -> JSON {pid: peak bytes}, `rescan` (no answer), EOF ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil

SELF_LABEL = "client (this process)"
REPLY_TIMEOUT_S = 30.0


class RssSampler:
    """Samples the RSS of this process and its descendants; `window()` reports the peaks inside it."""

    def __init__(self, interval_s: float = 0.01, rescan_s: float = 0.25) -> None:
        if not interval_s > 0 or not rescan_s > 0:
            raise ValueError(
                f"interval_s and rescan_s must be > 0, got {interval_s!r}, {rescan_s!r}"
            )
        self.interval_s, self.rescan_s = interval_s, rescan_s
        self._labels: dict[int, str] = {os.getpid(): SELF_LABEL}
        self._lock = threading.Lock()
        self._next_id = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> RssSampler:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.rss",
                str(os.getpid()),
                str(self.interval_s),
                str(self.rescan_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def label(self, pid: int, name: str) -> None:
        """Name process `pid` in reports (e.g. "rank 0 server") and have the sampler look for new children."""
        with self._lock:
            self._labels[pid] = name
            self._send("rescan")

    def label_of(self, pid: int) -> str:
        with self._lock:
            return self._labels.get(pid, f"pid {pid}")

    @contextmanager
    def window(self, pids: Iterable[int] | None = None) -> Iterator[dict[str, int]]:
        """Yield a dict filled on exit with {label: peak RSS bytes} of `pids` (default: every process seen)."""
        report: dict[str, int] = {}
        with self._lock:
            self._next_id += 1
            wid = self._next_id
            self._ask(f"open {wid}")
        try:
            yield report
        finally:
            with self._lock:
                peaks = {
                    int(pid): rss for pid, rss in json.loads(self._ask(f"close {wid}")).items()
                }
            wanted = set(peaks) if pids is None else set(pids)
            report.update(
                {self.label_of(pid): rss for pid, rss in sorted(peaks.items()) if pid in wanted}
            )

    def _send(self, line: str) -> None:
        if self._proc is None:
            raise RuntimeError("use RssSampler as a context manager")
        self._proc.stdin.write(line + "\n")

    def _ask(self, line: str) -> str:
        self._send(line)
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError(
                f"RSS sampler exited (code {self._proc.poll()}) before answering {line!r}"
            )
        return reply.strip()


class _Sampling:
    """The sampler process's state: the process tree under `root` and the open windows' peaks."""

    def __init__(self, root: int, rescan_s: float) -> None:
        self.root = psutil.Process(root)
        self.rescan_s = rescan_s
        self.known: list[psutil.Process] = []
        self.scanned_at = -1.0
        self.windows: dict[str, dict[int, int]] = {}
        self.lock = threading.Lock()

    def processes(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self.scanned_at >= self.rescan_s:
            self.scanned_at = now
            try:
                tree = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                tree = [self.root]
            self.known = [p for p in tree if p.pid != os.getpid()]
        return self.known

    def sample(self) -> None:
        with self.lock:
            readings = {}
            for proc in self.processes():
                try:
                    readings[proc.pid] = proc.memory_info().rss
                except psutil.Error:
                    continue
            for peaks in self.windows.values():
                for pid, rss in readings.items():
                    if rss > peaks.get(pid, 0):
                        peaks[pid] = rss


def _serve(sampling: _Sampling, done: threading.Event) -> None:
    """Answer the parent's commands from stdin until EOF."""
    for line in sys.stdin:
        command, _, wid = line.strip().partition(" ")
        if command == "open":
            with sampling.lock:
                sampling.windows[wid] = {}
            sampling.sample()
            print("ok", flush=True)
        elif command == "close":
            sampling.sample()
            with sampling.lock:
                peaks = sampling.windows.pop(wid, {})
            print(json.dumps(peaks), flush=True)
        elif command == "rescan":
            with sampling.lock:
                sampling.scanned_at = -1.0
    done.set()


def _sampler_main(argv: list[str]) -> None:
    root, interval_s, rescan_s = int(argv[0]), float(argv[1]), float(argv[2])
    sampling = _Sampling(root, rescan_s)
    done = threading.Event()
    threading.Thread(target=_serve, args=(sampling, done), daemon=True).start()
    while not done.wait(interval_s):
        if sampling.windows:
            sampling.sample()


if __name__ == "__main__":
    _sampler_main(sys.argv[1:])
