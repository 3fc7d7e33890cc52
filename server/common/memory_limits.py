"""How much memory this process may use: the host's physical memory, or less where the process's memory
cgroup (v1 `memory.limit_in_bytes`, v2 `memory.max`, the smallest along its hierarchy) says so.

Containers (Docker, Kubernetes) put every process under such a limit; a default computed from the host's
memory alone lets ranks admit more than the container holds, and the kernel then OOM-kills the whole
cluster. The parsing is pure (tested without processes); `effective_memory()` reads /proc and /sys.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

UNLIMITED_V1 = (
    1 << 62
)  # v1 reports "no limit" as a page-rounded 2**63 - 1; anything this large is none


@dataclass(frozen=True)
class MemoryLimit:
    """A number of bytes and where it came from (for logs and `shardserve status`)."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class CgroupMount:
    """A mounted cgroup hierarchy: its version (1 or 2), where it is mounted and which cgroup is its root."""

    version: int
    mount_point: str
    root: str


def cgroup_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup v2 mount and the v1 mounts that carry the memory controller, from /proc/self/mountinfo."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or dash < 5:
            continue
        root, mount_point = fields[3], fields[4]
        fs_type, super_options = fields[dash + 1], fields[dash + 3].split(",")
        if fs_type == "cgroup2":
            mounts.append(CgroupMount(2, mount_point, root))
        elif fs_type == "cgroup" and "memory" in super_options:
            mounts.append(CgroupMount(1, mount_point, root))
    return mounts


def own_cgroups(proc_cgroup: str) -> dict[int, str]:
    """This process's memory cgroup path per version, from /proc/self/cgroup ("ID:controllers:path")."""
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def limit_files(mount: CgroupMount, path: str) -> list[str]:
    """The limit files of cgroup `path` and of its ancestors up to the mount's root, innermost first."""
    name = "memory.max" if mount.version == 2 else "memory.limit_in_bytes"
    root = PurePosixPath(mount.root)
    relative = PurePosixPath(path)
    if root != PurePosixPath("/") and relative.is_relative_to(root):
        relative = PurePosixPath("/") / relative.relative_to(root)
    files = []
    current = relative
    while True:
        files.append(str(PurePosixPath(mount.mount_point) / current.relative_to("/") / name))
        if current == current.parent:
            return files
        current = current.parent


def parse_limit(text: str) -> int | None:
    """The bytes a limit file holds, or None for no limit ("max", or v1's huge number)."""
    value = text.strip()
    if not value.isdigit():
        return None
    number = int(value)
    return None if number >= UNLIMITED_V1 else number


def cgroup_limit(
    mountinfo: str, proc_cgroup: str, read: Callable[[str], str | None]
) -> MemoryLimit | None:
    """The smallest memory limit of this process's cgroups (every ancestor counts: a parent's limit binds its
    children), or None when no cgroup limits memory. `read(path)` is a file's text, or None if unreadable."""
    best: MemoryLimit | None = None
    own = own_cgroups(proc_cgroup)
    for mount in cgroup_mounts(mountinfo):
        path = own.get(mount.version)
        if path is None:
            continue
        for file in limit_files(mount, path):
            text = read(file)
            limit = parse_limit(text) if text is not None else None
            if limit is not None and (best is None or limit < best.nbytes):
                best = MemoryLimit(limit, f"cgroup v{mount.version} {file}")
    return best


def host_memory() -> MemoryLimit:
    """Physical memory of the host (a bound no process reaches where the platform cannot tell it)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return MemoryLimit(1 << 62, "host memory (unknown)")
    return MemoryLimit(physical, "host memory (/proc/meminfo)")


def effective_memory() -> MemoryLimit:
    """The smaller of the host's memory and this process's cgroup limit, with where it came from."""
    host = host_memory()
    limit = cgroup_limit(
        _text("/proc/self/mountinfo") or "", _text("/proc/self/cgroup") or "", _text
    )
    return limit if limit is not None and limit.nbytes < host.nbytes else host


def _text(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None
