"""The same-host data plane's contract, shared by server/rank (shared_memory.py, writes/shared.py) and
client/paths (shm.py, staging.py) so the two sides cannot drift: what "this host" is, the header words a rank
keeps before each shard segment, and the name a writer gives its staging memfds."""

from __future__ import annotations

import functools
import os

import numpy as np
import xxhash

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
HOST_NAMESPACES = (
    "net",
    "pid",
)  # a process in another network or PID namespace is another host here
# A shard segment's header: int64 words HEADER_MAGIC, state, generation, the writer's checksum and its tag,
# then the label of the shard it holds and the label's tag (OpenShardResponse.data_offset gives the header's
# length). A same-host writer that hashed the bytes it copied in place leaves their xxh3-64 in WORD_CHECKSUM and
# then generation_tag(generation) in WORD_CHECKSUM_TAG; the rank takes the checksum when the writer says the
# shard is written, if the tag names the segment's current generation (a recycled segment has a newer one), and
# hashes the shard itself otherwise. When the rank promotes a version it labels each of its segments with the
# shard it now serves (the hash of the tensor's name, the version, the shard's index), then tags the label with
# the generation: a reader that maps the segment already (the rank recycles it from one version to the next)
# finds a newer version's shard there by its label and reads it without asking the rank (write_label,
# read_label). When the rank promotes a version that is a whole copy of another (a delta snapshot's unchanged
# tensor: every block shared with the version it copied), it writes in the copied version's header where the
# copy's header words are (a slot of a header file: its offset, the file's inode, the slot's generation), named
# by the copy's label, and tags it with the copied header's generation: a reader that maps the copied version
# reads the copy through the same mapping, its state in the copy's own words, without asking the rank
# (write_successor, read_successor).
(
    WORD_MAGIC,
    WORD_STATE,
    WORD_GENERATION,
    WORD_CHECKSUM,
    WORD_CHECKSUM_TAG,
    WORD_LABEL_NAME,
    WORD_LABEL_VERSION,
    WORD_LABEL_SHARD,
    WORD_LABEL_TAG,
    WORD_SUCCESSOR_NAME,
    WORD_SUCCESSOR_VERSION,
    WORD_SUCCESSOR_SHARD,
    WORD_SUCCESSOR_SLOT,
    WORD_SUCCESSOR_FILE,
    WORD_SUCCESSOR_GENERATION,
    WORD_SUCCESSOR_TAG,
) = range(16)
HEADER_WORDS = 16
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


def generation_tag(generation: int) -> int:
    """The tag word saying the words before it hold what they hold for `generation` of the segment (never 0, the
    word of a new segment): the writer's checksum of its bytes, or the rank's label of its shard."""
    return 2 * generation + 1


@functools.lru_cache(maxsize=65536)
def name_hash(name: str) -> int:
    """The label word of a tensor name: its xxh3-64 as a signed int64 (a header word); computed once per name (a
    reader asks it of every shard of every version it reads)."""
    return int(np.uint64(xxhash.xxh3_64_intdigest(name.encode("utf-8"))).view(np.int64))


def write_label(words: np.ndarray, name: str, version: int, index: int) -> None:
    """The rank's half, when it promotes a version and before it marks it served: label the segment of shard
    `index` of (`name`, `version`) in its header `words` (int64), the label first and its tag after it. The
    generation is the segment's current one: a recycled segment gets a newer one before any of its bytes change,
    which makes this label stale at once."""
    words[WORD_LABEL_NAME] = name_hash(name)
    words[WORD_LABEL_VERSION] = version
    words[WORD_LABEL_SHARD] = index
    words[WORD_LABEL_TAG] = generation_tag(int(words[WORD_GENERATION]))


def read_label(words: np.ndarray) -> tuple[int, int, int, int] | None:
    """The reader's half: (name hash, version, shard index, generation) of the shard the segment whose header is
    `words` serves now, or None (not served, or no label of its current generation). Read as a seqlock: state and
    generation before the label and again after it, so a segment recycled meanwhile is never taken (the rank
    changes the generation before it writes a new label or any byte)."""
    state, generation = int(words[WORD_STATE]), int(words[WORD_GENERATION])
    if state != STATE_SERVED or int(words[WORD_LABEL_TAG]) != generation_tag(generation):
        return None
    name, version, index = (
        int(words[WORD_LABEL_NAME]),
        int(words[WORD_LABEL_VERSION]),
        int(words[WORD_LABEL_SHARD]),
    )
    if (int(words[WORD_STATE]), int(words[WORD_GENERATION])) != (state, generation):
        return None
    return name, version, index, generation


def labelled_generation(words: np.ndarray, name: str, version: int, index: int) -> int | None:
    """The segment's generation when its header `words` say it serves shard `index` of (`name`, `version`) now
    (read_label), else None."""
    found = read_label(words)
    if found is None or found[:3] != (name_hash(name), version, index):
        return None
    return found[3]


def write_successor(  # noqa: PLR0913 - a label and where the copy's header words are
    words: np.ndarray, name: str, version: int, index: int, *, slot: tuple[int, int, int]
) -> None:
    """The rank's half, when it promotes shard `index` of (`name`, `version`), a whole copy of the version whose
    header `words` are: where the copy's header words are, `slot` (offset in its header file, the file's inode,
    the slot's generation), named by the copy's label; the tag (the copied header's generation) last."""
    words[WORD_SUCCESSOR_TAG] = 0
    words[WORD_SUCCESSOR_NAME] = name_hash(name)
    words[WORD_SUCCESSOR_VERSION] = version
    words[WORD_SUCCESSOR_SHARD] = index
    words[WORD_SUCCESSOR_SLOT], words[WORD_SUCCESSOR_FILE], words[WORD_SUCCESSOR_GENERATION] = slot
    words[WORD_SUCCESSOR_TAG] = generation_tag(int(words[WORD_GENERATION]))


def read_successor(words: np.ndarray) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """The reader's half: ((name hash, version, shard index) of the whole copy of this header's version, (slot
    offset, header file inode, slot generation) of the copy's header words), or None (none written for the
    header's current generation). Read as a seqlock: the tag before the words and again after them."""
    tag = int(words[WORD_SUCCESSOR_TAG])
    if tag != generation_tag(int(words[WORD_GENERATION])):
        return None
    label = (
        int(words[WORD_SUCCESSOR_NAME]),
        int(words[WORD_SUCCESSOR_VERSION]),
        int(words[WORD_SUCCESSOR_SHARD]),
    )
    slot = (
        int(words[WORD_SUCCESSOR_SLOT]),
        int(words[WORD_SUCCESSOR_FILE]),
        int(words[WORD_SUCCESSOR_GENERATION]),
    )
    if int(words[WORD_SUCCESSOR_TAG]) != tag or int(words[WORD_GENERATION]) != tag // 2:
        return None
    return label, slot


def leave_checksum(words: np.ndarray, checksum: int) -> None:
    """A writer's half: leave the xxh3-64 `checksum` of the bytes it wrote in the header `words` (int64), the
    checksum first and the tag after it."""
    words[WORD_CHECKSUM] = np.uint64(checksum).view(np.int64)
    words[WORD_CHECKSUM_TAG] = generation_tag(int(words[WORD_GENERATION]))


def left_checksum(words: np.ndarray) -> int | None:
    """The rank's half: the checksum a writer left in the header `words` for the current generation, or None."""
    if int(words[WORD_CHECKSUM_TAG]) != generation_tag(int(words[WORD_GENERATION])):
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
