"""Peak resident memory of processes during a window of time, sampled by a background thread.

VmHWM cannot be reset between scenarios, so a thread samples VmRSS (psutil's
`memory_info().rss`) of this process and every descendant every few
milliseconds and keeps the maximum seen inside each open window.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import psutil

SELF_LABEL = "client (this process)"


class RssSampler:
    """Samples the RSS of this process and its descendants; `window()` reports the peaks inside it."""

    def __init__(self, interval_s: float = 0.01, rescan_s: float = 0.25) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.rescan_s = rescan_s
        self._known: list[psutil.Process] = []
        self._scanned_at = -1.0
        self._me = psutil.Process(os.getpid())
        self._labels: dict[int, str] = {os.getpid(): SELF_LABEL}
        self._windows: list[dict[int, int]] = []
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RssSampler":
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def label(self, pid: int, name: str) -> None:
        """Name process `pid` in reports (e.g. "rank 0 server") and look for new children at the next sample."""
        with self._lock:
            self._labels[pid] = name
            self._scanned_at = -1.0

    def label_of(self, pid: int) -> str:
        with self._lock:
            return self._labels.get(pid, f"pid {pid}")

    @contextmanager
    def window(self, pids: Iterable[int] | None = None) -> Iterator[dict[str, int]]:
        """Yield a dict filled on exit with {label: peak RSS bytes} of `pids` (default: every process seen)."""
        peaks: dict[int, int] = {}
        report: dict[str, int] = {}
        with self._lock:
            self._windows.append(peaks)
        self._sample()
        try:
            yield report
        finally:
            self._sample()
            with self._lock:
                self._windows.remove(peaks)
            wanted = set(peaks) if pids is None else set(pids)
            report.update({self.label_of(pid): rss for pid, rss in sorted(peaks.items()) if pid in wanted})

    def _processes(self) -> list[psutil.Process]:
        """This process and its descendants; the (costly) scan for new children runs every `rescan_s`."""
        now = time.monotonic()
        if now - self._scanned_at >= self.rescan_s:
            self._scanned_at = now
            try:
                self._known = [self._me] + self._me.children(recursive=True)
            except psutil.Error:
                self._known = [self._me]
        return self._known

    def _sample(self) -> None:
        readings = {}
        with self._sample_lock:
            for proc in self._processes():
                try:
                    readings[proc.pid] = proc.memory_info().rss
                except psutil.Error:
                    continue
        with self._lock:
            for peaks in self._windows:
                for pid, rss in readings.items():
                    if rss > peaks.get(pid, 0):
                        peaks[pid] = rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._windows:
                self._sample()
