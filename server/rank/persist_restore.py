"""Reading a rank's persist dir back at start: every version to hold again, and what each tensor's folder holds.

Every version with a manifest not dropped since, and the newest promoted update versions (their snapshot
ancestor plus the logged rows, replayed in order), is read back whole, every shard file checked against the
checksum beside it in its manifest; a tensor whose files are corrupt is named in the log, reported to
`corrupt`, and left out (server/rank/persistence.py describes the layout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.core.wire import metadata_from_proto, options_from_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.persist_files import (
    CorruptFile,
    LogRecord,
    read_json,
    read_log,
    read_shard_file,
)

log = logging.getLogger(__name__)

LOG_NAME = "updates.log"
NAME_FILE = (
    "tensor.json"  # the tensor's name: folders are named by a hash of it (server.common.names)
)
# Promoted update versions restored per table, newest first: a rank promotes (and logs) an update before the
# coordinator's catalog commits it, so a crash in between leaves the catalog one version behind the log.
RESTORED_UPDATES = 2

Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
Corrupt = Callable[[str, str], None]  # (tensor name, what is wrong with which file)


@dataclass
class RestoredVersion:
    """A version read back from disk, every local shard whole, ready to install as PENDING."""

    name: str
    version: int
    metadata: ShardedTensorMetadata
    options: TensorOptions
    shards: dict[int, torch.Tensor]
    checksums: dict[int, int] = field(
        default_factory=dict
    )  # the checked ones (none after logged rows)


@dataclass
class RestoreCount:
    """How far a restore is: bytes of the persist dir read of all, tensors (folders) done of all."""

    done_bytes: int = 0
    total_bytes: int = 0
    done_tensors: int = 0
    total_tensors: int = 0


@dataclass
class RestoredTable:
    """One tensor's folder as read back: its snapshots, its update copies (version -> source) and the versions
    to hold again (none when its files are corrupt)."""

    name: str
    folder: Path
    snapshots: set[int] = field(default_factory=set)
    copies: dict[int, int] = field(default_factory=dict)
    versions: list[RestoredVersion] = field(default_factory=list)


def restore_dir(
    root: Path,
    rank: int,
    empty: Empty,
    device: torch.device,
    progress: Callable[[RestoreCount], None] | None = None,
    corrupt: Corrupt | None = None,
) -> list[RestoredTable]:
    """Every tensor folder under `root` read back (`empty(sizes, dtype)` allocates each host shard); `progress`
    sees the bytes and tensors read so far, before the first tensor and after each; `corrupt` hears of each
    tensor left out for a corrupt file."""
    out: list[RestoredTable] = []
    if not root.is_dir():
        return out
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    count = RestoreCount(
        total_bytes=sum(_folder_bytes(f) for f in folders), total_tensors=len(folders)
    )
    if progress is not None:
        progress(count)
    for folder in folders:
        restored = _restore_folder(folder, rank, empty, device, corrupt)
        if restored is not None:
            out.append(restored)
        count.done_bytes += _folder_bytes(folder)
        count.done_tensors += 1
        if progress is not None:
            progress(count)
    return out


def _restore_folder(
    folder: Path, rank: int, empty: Empty, device: torch.device, corrupt: Corrupt | None
) -> RestoredTable | None:
    """Restore one tensor's folder; corrupt files are named in the log and its versions left out (None for
    a folder that names no tensor)."""
    name = _name_of(folder)
    if name is None:
        log.warning("rank %d skips %s: it holds no tensor.json and no manifest", rank, folder)
        return None
    table = RestoredTable(name, folder)
    started = time.monotonic()
    try:
        _restore_table(table, folder, rank, empty, device)
    except CorruptFile as err:
        log.error(
            "rank %d refuses to serve %r: %s (the coordinator marks its copies lost and repairs "
            "them from a replica, if any)",
            rank,
            table.name,
            err,
        )
        if corrupt is not None:
            corrupt(table.name, str(err))
        table.versions = []
        return table
    for restored in table.versions:
        log.info(
            "rank %d restored %r version %d (%d shards) from %s in %.2fs",
            rank,
            table.name,
            restored.version,
            len(restored.shards),
            folder,
            time.monotonic() - started,
        )
    return table


def _restore_table(
    table: RestoredTable, folder: Path, rank: int, empty: Empty, device: torch.device
) -> None:
    manifests = {int(p.stem[1:]): p for p in folder.glob("v*.json") if p.stem[1:].isdigit()}
    copies, rows, promoted, dropped = _replay_index(read_log(folder / LOG_NAME))
    table.snapshots = set(manifests)
    table.copies = dict(copies)
    wanted = [v for v in manifests if v not in dropped]
    updates = sorted(v for v in promoted if v not in dropped and v in copies)
    wanted.extend(
        updates[-RESTORED_UPDATES:]
    )  # the catalog may still be at the one before the newest
    for version in sorted(set(wanted)):
        chain = _chain(version, copies, manifests, table.name)
        base = _load_snapshot(manifests[chain[0]], rank, empty, device)
        for step in chain[1:]:
            _apply_rows(base.shards, rows.get(step, []), table.name, step)
            base.checksums = {}  # rows changed the bytes: the promote hashes them again
        base.version = version
        table.versions.append(base)


def _load_snapshot(
    manifest_path: Path, rank: int, empty: Empty, device: torch.device
) -> RestoredVersion:
    manifest = read_json(manifest_path)
    meta = metadata_from_proto(
        pb.ShardedTensorMetadata.FromString(bytes.fromhex(manifest["metadata"]))
    )
    options = options_from_proto(pb.TensorOptions.FromString(bytes.fromhex(manifest["options"])))
    expected = set(meta.shards_on(rank))
    if {int(i) for i in manifest["shards"]} != expected:
        raise CorruptFile(
            f"{manifest_path}: lists shards {sorted(manifest['shards'])}, this rank holds "
            f"{sorted(expected)}"
        )
    shards, checksums = {}, {}
    for index in sorted(expected):
        entry = manifest["shards"][str(index)]
        host = empty(meta.shards_metadata[index].shard_sizes, meta.dtype)
        checksums[index] = read_shard_file(manifest_path.parent / entry["file"], host, entry)
        shards[index] = host if device.type == "cpu" else host.to(device)
    return RestoredVersion(
        manifest["name"], int(manifest["version"]), meta, options, shards, checksums
    )


def _name_of(folder: Path) -> str | None:
    """The tensor a folder holds: from its NAME_FILE, else from a manifest (folders made before NAME_FILE)."""
    for path in [folder / NAME_FILE, *sorted(folder.glob("v*.json"))]:
        try:
            name = read_json(path).get("name") if path.is_file() else None
        except CorruptFile:
            continue
        if isinstance(name, str) and name:
            return name
    return None


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files of one tensor's folder (what its restore reads, at most)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _replay_index(
    records: Iterable[LogRecord],
) -> tuple[dict[int, int], dict[int, list[LogRecord]], set[int], set[int]]:
    """The log's copies (version -> source), rows per version in order, promoted and dropped versions."""
    copies: dict[int, int] = {}
    rows: dict[int, list[LogRecord]] = {}
    promoted: set[int] = set()
    dropped: set[int] = set()
    for record in records:
        kind, version = record.header["kind"], int(record.header["version"])
        if kind == "copy":
            copies[version] = int(record.header["source"])
        elif kind == "rows":
            rows.setdefault(version, []).append(record)
        elif kind == "promote":
            promoted.add(version)
        elif kind == "drop":
            dropped.add(version)
    return copies, rows, promoted, dropped


def _chain(
    version: int, copies: dict[int, int], manifests: dict[int, Path], name: str
) -> list[int]:
    """Versions from a snapshot to `version` through the log's copies, oldest first."""
    chain = [version]
    while chain[-1] not in manifests:
        source = copies.get(chain[-1])
        if source is None or len(chain) > len(copies) + 1:
            raise CorruptFile(
                f"{name!r} version {version}: no snapshot to rebuild it from (version {chain[-1]} "
                f"has neither a manifest nor a source in the update log)"
            )
        chain.append(source)
    return chain[::-1]


def _apply_rows(
    shards: dict[int, torch.Tensor], records: list[LogRecord], name: str, version: int
) -> None:
    for record in records:
        index, count = int(record.header["shard"]), int(record.header["count"])
        shard = shards.get(index)
        if shard is None:
            raise CorruptFile(
                f"update log of {name!r} version {version}: rows of shard {index}, not held here"
            )
        ids = torch.from_numpy(np.frombuffer(record.data[: 8 * count], dtype="<i8").copy())
        values = torch.frombuffer(bytearray(record.data[8 * count :]), dtype=torch.uint8)
        if shard.dim() != 2 or values.numel() != count * shard.shape[1] * shard.element_size():
            raise CorruptFile(
                f"update log of {name!r} version {version}: a rows record does not fit shard {index}"
            )
        shard.index_copy_(
            0, ids.to(shard.device), values.view(shard.dtype).view(count, -1).to(shard.device)
        )
