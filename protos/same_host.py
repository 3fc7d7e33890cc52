"""The same-host data plane's contract, shared by server/rank (shared_memory.py, writes/shared.py) and
client/paths (shm.py, staging.py) so the two sides cannot drift: what "this host" is, the header words a rank
keeps before each shard segment, and the name a writer gives its staging memfds."""

from __future__ import annotations

import os

import numpy as np

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
HOST_NAMESPACES = (
    "net",
    "pid",
)  # a process in another network or PID namespace is another host here
# A shard segment's header: int64 words HEADER_MAGIC, state, generation, the writer's checksum and its tag
# (OpenShardResponse.data_offset gives the header's length). A same-host writer that hashed the bytes it copied
# in place leaves their xxh3-64 in WORD_CHECKSUM and then checksum_tag(generation) in WORD_CHECKSUM_TAG; the
# rank takes the checksum when the writer says the shard is written, if the tag names the segment's current
# generation (a recycled segment has a newer one), and hashes the shard itself otherwise.
WORD_MAGIC, WORD_STATE, WORD_GENERATION, WORD_CHECKSUM, WORD_CHECKSUM_TAG = range(5)
HEADER_WORDS = 5
HEADER_MAGIC = 0x5348415244535256  # "SHARDSRV"
STATE_PENDING, STATE_SERVED, STATE_DROPPED, STATE_REPLACED = (
    0,
    1,
    2,
    3,
)  # replaced: served in its grace period
STAGING_NAME = (
    "shardserve-staging-"  # a writer's staging memfd is named this + the request's name_secret
)


def checksum_tag(generation: int) -> int:
    """The tag word saying WORD_CHECKSUM holds the writer's checksum of the bytes of `generation` (never 0, the
    word of a new segment)."""
    return 2 * generation + 1


def leave_checksum(words: np.ndarray, checksum: int) -> None:
    """A writer's half: leave the xxh3-64 `checksum` of the bytes it wrote in the header `words` (int64), the
    checksum first and the tag after it."""
    words[WORD_CHECKSUM] = np.uint64(checksum).view(np.int64)
    words[WORD_CHECKSUM_TAG] = checksum_tag(int(words[WORD_GENERATION]))


def left_checksum(words: np.ndarray) -> int | None:
    """The rank's half: the checksum a writer left in the header `words` for the current generation, or None."""
    if int(words[WORD_CHECKSUM_TAG]) != checksum_tag(int(words[WORD_GENERATION])):
        return None
    return int(words[WORD_CHECKSUM : WORD_CHECKSUM + 1].view(np.uint64)[0])


# (pid, host id): read once per process, asked on every write batch
_KNOWN: tuple[int, str] | None = None


def host_id() -> str:
    """This process's host as the same-host data path sees it: the kernel's boot id and the process's network and
    PID namespaces ("" when the boot id is unknown). Equal hostnames and host ids mean one host: one kernel,
    /proc/<pid> naming the same process, and one network (processes in other network namespaces, as containers
    or test rigs, talk over the network, so a cut link isolates them for the data plane too). Read once per
    process (a forked child reads its own)."""
    global _KNOWN
    known = _KNOWN
    if known is None or known[0] != os.getpid():
        known = _KNOWN = (os.getpid(), _read_host_id())
    return known[1]


def _read_host_id() -> str:
    try:
        with open(BOOT_ID_FILE) as f:
            boot_id = f.read().strip()
    except OSError:
        return ""
    return ";".join([boot_id, *(f"{kind}:{_namespace(kind)}" for kind in HOST_NAMESPACES)])


def _namespace(kind: str) -> int:
    """The inode of this process's `kind` namespace (0 when /proc does not say)."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0
