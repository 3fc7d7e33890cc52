"""One tensor's folder as a persisting rank holds it: its update log, open for appends, and the snapshots
and update copies in it.

server/rank/persistence.py decides what is written when (snapshots, log records, fsyncs, compaction); a
PersistTable does the file work on one folder and keeps what this process knows of it up to date. It locks
the lock its Persistence shares with every table where the work must not interleave with another thread's.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from shardserve.server.rank.persist_files import (
    LogRecord,
    encode_record,
    fsync_dir,
    read_log,
    write_json,
)
from shardserve.server.rank.persist_restore import LOG_NAME, NAME_FILE


@dataclass
class PersistTable:
    """What this process knows of one tensor's folder: its log (open for appends) and the versions in it."""

    path: Path
    lock: threading.RLock = field(repr=False, compare=False)
    log_file: BinaryIO | None = None
    log_bytes: int = 0
    dirty: bool = False
    copies: dict[int, int] = field(default_factory=dict)  # update version -> its source version
    snapshots: set[int] = field(default_factory=set)  # versions with a manifest on disk
    compacting: bool = False
    newest_served: int = 0  # the newest update version served (what compaction snapshots)

    def make_folder(self, name: str, sync: bool) -> None:
        """The tensor's folder, made with its NAME_FILE (the real name: the folder's own name is a hash);
        `sync` False leaves the fsync of NAME_FILE to the caller (a batch's sync, or none at all)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not (self.path / NAME_FILE).exists():
            write_json(self.path / NAME_FILE, {"name": name}, sync=sync)

    def append(self, name: str, record: LogRecord, fsync: bool, sync_folder: bool) -> None:
        """Append one record to the log, opening it (and making the folder, its NAME_FILE synced when
        `sync_folder`) on the first; fsync it now when `fsync`. OSError is the caller's to report."""
        with self.lock:
            if self.log_file is None:
                self.make_folder(name, sync=sync_folder)
                self.log_file = open(self.path / LOG_NAME, "ab")
                self.log_bytes = self.log_file.tell()
            encoded = encode_record(record)
            self.log_file.write(encoded)
            self.log_file.flush()
            self.log_bytes += len(encoded)
            self.dirty = True
            if fsync:
                os.fsync(self.log_file.fileno())
                self.dirty = False

    def remove_snapshot(self, version: int) -> None:
        """Remove the manifest and shard files of snapshot `version`, and forget it."""
        (self.path / f"v{version}.json").unlink(missing_ok=True)
        for path in self.path.glob(f"v{version}.s*.safetensors"):
            path.unlink(missing_ok=True)
        with self.lock:
            self.snapshots.discard(version)

    def restart_log(self, version: int) -> None:
        """Keep only the log records of versions after `version` (rewritten whole, fsynced, renamed into
        place); remove snapshots before it."""
        with self.lock:
            path = self.path / LOG_NAME
            if self.log_file is not None:
                self.log_file.close()
            kept = [r for r in read_log(path) if r.header["version"] > version]
            tmp = path.with_name(LOG_NAME + ".tmp")
            with open(tmp, "wb") as f:
                for record in kept:
                    f.write(encode_record(record))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(self.path)
            self.log_file = open(path, "ab")
            self.log_bytes = self.log_file.tell()
            self.copies = {v: s for v, s in self.copies.items() if v > version}
            for old in [v for v in self.snapshots if v < version]:
                self.remove_snapshot(old)
