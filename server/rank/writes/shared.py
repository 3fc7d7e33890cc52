"""The same-host source of WriteShards: a writer's staging memfd, read by the rank through /proc/PID/fd/FD.

The reverse of the same-host read path (server/rank/reads/shm.py): there the
client opens the rank's sealed shard segment; here the rank opens the
writer's staging memfd read-only and `preadv`s each shard's bytes straight into
the shard's memory (one copy, no mapping of a file another process could
truncate). The rank accepts only a file that is exactly the one the writer
described: on this host (host id), with that inode and device, of that size,
and a memfd named with the writer's secret, so a caller cannot make the rank
read another process's files by naming its pid and fd. A source the rank cannot
use (other host, shared memory off, the fd cannot be opened) is UNIMPLEMENTED:
the writer falls back to the network.
"""

from __future__ import annotations

import os
import re
import stat
from types import TracebackType

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import STAGING_NAME, host_id
from shardserve.server.rank.errors import InvalidArgument, PathUnavailable, PermissionDenied

_SECRET = re.compile(r"[A-Za-z0-9_-]{16,64}")


class SharedSource:
    """An open, checked staging memfd of a same-host writer; a context manager that closes it."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self._fd = fd
        self.nbytes = nbytes

    @classmethod
    def open(cls, source: pb.SharedMemorySource, needed: int, enabled: bool) -> SharedSource:
        """The writer's file, checked; `needed`: the bytes the batch's shards take (they must lie within it)."""
        if not enabled:
            raise PathUnavailable(
                "shared: this rank does not use shared memory; write over the network"
            )
        if source.host_id != host_id():
            raise PathUnavailable(
                "shared.host_id: the writer is not on this rank's host (or in another "
                "network or PID namespace); write over the network"
            )
        if not _SECRET.fullmatch(source.name_secret):
            raise InvalidArgument("shared.name_secret must be 16-64 letters, digits, '-' or '_'")
        if source.nbytes < needed:
            raise InvalidArgument(
                f"shared.nbytes {source.nbytes} is less than the {needed} bytes of the "
                f"batch's shards"
            )
        try:
            fd = os.open(f"/proc/{source.pid}/fd/{source.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise PathUnavailable(
                f"shared: cannot open fd {source.fd} of process {source.pid}: {err.strerror}"
            ) from None
        try:
            _check_file(fd, source)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, source.nbytes)

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill `view` with the file's bytes from `offset` on."""
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count <= 0:
                raise InvalidArgument(
                    f"shared: the file ended at byte {offset + done}, before the batch's bytes did"
                )
            done += count

    def __enter__(self) -> SharedSource:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        os.close(self._fd)


def _check_file(fd: int, source: pb.SharedMemorySource) -> None:
    """PERMISSION_DENIED unless `fd` is the writer's staging memfd as described (inode, device, size, name)."""
    info = os.fstat(fd)
    link = os.readlink(f"/proc/self/fd/{fd}")
    expected = f"/memfd:{STAGING_NAME}{source.name_secret} (deleted)"
    if (
        (info.st_ino, info.st_dev) != (source.inode, source.device_id)
        or link != expected
        or not stat.S_ISREG(info.st_mode)
    ):
        raise PermissionDenied(
            f"shared: fd {source.fd} of process {source.pid} is not the staging memfd the request "
            f"describes (inode, device or name differ)",
            metadata={"field": "shared"},
        )
    if info.st_size != source.nbytes:
        raise InvalidArgument(
            f"shared.nbytes {source.nbytes} is not the file's size of {info.st_size} bytes"
        )
