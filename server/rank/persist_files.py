"""The files a persisting rank writes: safetensors shard files, JSON manifests and the update log.

Shard files are safetensors (one tensor, "shard", per file) so any tool reads
them (`safetensors.torch.load_file`, or by hand: an 8-byte header length, a
JSON header, raw little-endian bytes); the header's `__metadata__` names the
tensor, version, shard and its checksum (xxh3-64 of the data bytes, the shard's
checksum in the catalog: shardserve.core.checksums; files written before
checksums carry a CRC-32 instead, still checked on restore). Every file is written to a temporary
name, fsynced, renamed into place and its directory fsynced: a crash leaves
either the old file or the new one, never half of one. The update log is a
sequence of framed records (magic, length, CRC-32, payload); a torn tail (a
crash in the middle of an append) ends the log, a bad record followed by more
bytes is corruption.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

from shardserve.core.checksums import tensor_checksum
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.core.wire import metadata_to_proto, options_to_proto
from shardserve.server.rank.errors import DiskFull, RankUnavailable

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.complex128: "C128",
}
RECORD_MAGIC = 0x5353_4C47  # "SSLG"
_FRAME = struct.Struct("<III")  # magic, payload length, CRC-32 of the payload
_COPY_BYTES = 8 << 20


class CorruptFile(Exception):
    """A persisted file that does not hold what its checksum or format says (named in the message)."""


def disk_error(rank: int, path: Path, err: OSError) -> Exception:
    """The service error for a failed disk write: RESOURCE_EXHAUSTED when the disk is full, else UNAVAILABLE;
    both name the rank and the path."""
    what = f"rank {rank} could not persist {path}: {err.strerror or err}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DiskFull(f"{what} (disk full); nothing was acknowledged")
    return RankUnavailable(f"{what}; nothing was acknowledged")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux: sync_filesystem falls back on sync(2)
        return None


_SYNCFS = _libc_syncfs()


def sync_filesystem(path: Path) -> None:
    """Flush every file and folder written on the filesystem that holds `path`: one syncfs(2) (which reports
    write-back errors since Linux 5.8), or sync(2) where there is none. A batch's one sync round."""
    if _SYNCFS is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)


def tensor_memory(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a C-contiguous tensor (copied to the host first when on a device)."""
    host = tensor.detach().cpu().contiguous()
    if host.numel() == 0:
        return memoryview(b"")
    return host.view(-1).view(torch.uint8).numpy().data


def write_shard_file(
    path: Path,
    tensor: torch.Tensor,
    metadata: dict[str, str],
    sync: bool,
    checksum: int | None = None,
) -> int:
    """Write `tensor` as a one-tensor safetensors file at `path` (temporary name, fsync, rename); returns its
    checksum (`checksum` when the caller knows it already, else hashed here), also in the header's
    __metadata__["xxh3_64"]."""
    data = tensor_memory(tensor)
    if checksum is None:
        checksum = tensor_checksum(tensor)
    header = {
        "__metadata__": {**metadata, "xxh3_64": f"{checksum:016x}"},
        "shard": {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [0, len(data)],
        },
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for start in range(0, len(data), _COPY_BYTES):
                f.write(data[start : start + _COPY_BYTES])
            if sync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial file of a full disk would keep it full
        raise
    os.replace(tmp, path)
    return checksum


@dataclass(frozen=True)
class PromoteItem:
    """One version of a PromoteMany batch: its layout, options, local shards (leased by the caller) and their
    checksums (written beside each shard; hashed when writing for a shard missing here)."""

    name: str
    version: int
    meta: ShardedTensorMetadata
    options: TensorOptions
    shards: dict[int, torch.Tensor]
    checksums: dict[int, int] = field(default_factory=dict)


def write_version_shards(
    folder: Path,
    rank: int,
    name: str,
    version: int,
    shards: dict[int, torch.Tensor],
    *,
    sync: bool,
    checksums: dict[int, int] | None = None,
) -> dict[str, dict]:
    """Write every local shard of (name, version) into `folder`; returns the manifest's "shards" entry (each
    shard's file and checksum). An OSError names the file that failed (its `filename`)."""
    files = {}
    known = checksums or {}
    for index, tensor in sorted(shards.items()):
        path = folder / f"v{version}.s{index}.safetensors"
        metadata = {"name": name, "version": str(version), "shard_index": str(index)}
        try:
            checksum = write_shard_file(
                path, tensor, {**metadata, "rank": str(rank)}, sync, known.get(index)
            )
        except OSError as err:
            err.filename = err.filename or str(path)
            raise
        files[str(index)] = {"file": path.name, "xxh3_64": f"{checksum:016x}"}
    return files


def write_manifest(
    folder: Path,
    name: str,
    version: int,
    files: dict[str, dict],
    *,
    meta: ShardedTensorMetadata,
    options: TensorOptions,
    sync: bool,
) -> None:
    """Write the manifest of (name, version), the commit point on disk (after its shard files)."""
    path = folder / f"v{version}.json"
    document = {
        "name": name,
        "version": version,
        "shards": files,
        "metadata": metadata_to_proto(meta).SerializeToString().hex(),
        "options": options_to_proto(options).SerializeToString().hex(),
    }
    try:
        write_json(path, document, sync)
    except OSError as err:
        err.filename = err.filename or str(path)
        raise


def read_shard_file(path: Path, into: torch.Tensor, entry: dict) -> int:
    """Read the safetensors file at `path` into the preallocated host tensor `into`, checking its shape, dtype
    and bytes against the manifest's `entry` (its "xxh3_64", or the "crc32" of files written before
    checksums); returns the shard's checksum. CorruptFile naming the path and the checksums otherwise."""
    expected, hasher = _expected_sum(path, entry)
    try:
        with open(path, "rb") as f:
            header = _read_header(f, path)
            shard = header.get("shard") or {}
            if shard.get("dtype") != SAFETENSORS_DTYPES[into.dtype] or shard.get("shape") != list(
                into.shape
            ):
                raise CorruptFile(
                    f"{path}: holds {shard.get('dtype')} {shard.get('shape')}, expected "
                    f"{SAFETENSORS_DTYPES[into.dtype]} {list(into.shape)}"
                )
            view = tensor_memory(into) if into.numel() else memoryview(bytearray())
            got = 0
            while got < len(view):
                n = f.readinto(view[got : got + _COPY_BYTES])
                if not n:
                    raise CorruptFile(f"{path}: truncated: {got} of {len(view)} data bytes")
                hasher.update(view[got : got + n])
                got += n
            if f.read(1):
                raise CorruptFile(f"{path}: bytes past the end of the tensor")
    except OSError as err:
        raise CorruptFile(f"{path}: {err.strerror or err}") from None
    seen = hasher.intdigest()
    if seen != expected:
        kind = "CRC-32" if isinstance(hasher, _Crc32) else "xxh3-64"
        raise CorruptFile(
            f"{path}: checksum mismatch ({kind} {seen:x}, expected {expected:x}): the file changed "
            f"on disk since it was written"
        )
    return seen if not isinstance(hasher, _Crc32) else tensor_checksum(into)


class _Crc32:
    """zlib's CRC-32 with xxhash's streaming interface (files written before xxh3-64 checksums)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _expected_sum(path: Path, entry: dict) -> tuple[int, xxhash.xxh3_64 | _Crc32]:
    """The checksum a manifest entry gives a shard file, and a hasher of the same kind."""
    try:
        if "xxh3_64" in entry:
            return int(entry["xxh3_64"], 16), xxhash.xxh3_64()
        return int(entry["crc32"]), _Crc32()
    except (KeyError, TypeError, ValueError):
        raise CorruptFile(f"{path}: its manifest entry has no readable checksum") from None


def _read_header(f: BinaryIO, path: Path) -> dict:
    raw = f.read(8)
    if len(raw) != 8:
        raise CorruptFile(f"{path}: truncated header")
    (length,) = struct.unpack("<Q", raw)
    if length > 100 << 20:
        raise CorruptFile(f"{path}: header length {length} is not plausible")
    try:
        return json.loads(f.read(length))
    except ValueError:
        raise CorruptFile(f"{path}: header is not JSON") from None


def write_json(path: Path, value: dict, sync: bool) -> None:
    """Write a small JSON file atomically (temporary name, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise CorruptFile(f"{path}: unreadable manifest: {err}") from None


@dataclass(frozen=True)
class LogRecord:
    """One update-log record: a JSON header and its raw bytes (row ids then row values, for "rows")."""

    header: dict
    data: bytes = b""


def encode_record(record: LogRecord) -> bytes:
    head = json.dumps(record.header, separators=(",", ":")).encode()
    payload = struct.pack("<I", len(head)) + head + record.data
    return _FRAME.pack(RECORD_MAGIC, len(payload), zlib.crc32(payload)) + payload


def read_log(path: Path) -> Iterator[LogRecord]:
    """The records of the log at `path` in order; a torn last record (a crash mid-append) ends it quietly, a
    bad record with bytes after it raises CorruptFile naming the path and offset."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as err:
        raise CorruptFile(f"{path}: {err.strerror or err}") from None
    offset = 0
    while offset < len(raw):
        frame = raw[offset : offset + _FRAME.size]
        bad = len(frame) < _FRAME.size
        if not bad:
            magic, length, crc = _FRAME.unpack(frame)
            payload = raw[offset + _FRAME.size : offset + _FRAME.size + length]
            bad = magic != RECORD_MAGIC or len(payload) != length or zlib.crc32(payload) != crc
        if bad:
            if _is_tail(raw, offset):
                return
            raise CorruptFile(f"{path}: bad record at byte {offset} of {len(raw)}")
        (head_len,) = struct.unpack_from("<I", payload)
        yield LogRecord(json.loads(payload[4 : 4 + head_len]), payload[4 + head_len :])
        offset += _FRAME.size + length


def _is_tail(raw: bytes, offset: int) -> bool:
    """Whether a bad record at `offset` is the torn last append: no complete frame can follow it."""
    if len(raw) - offset < _FRAME.size:
        return True
    magic, length, _ = _FRAME.unpack_from(raw, offset)
    return (
        magic == RECORD_MAGIC
        and offset + _FRAME.size + length > len(raw)
        or raw[offset:].count(struct.pack("<I", RECORD_MAGIC)) <= 1
    )
