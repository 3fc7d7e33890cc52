"""server.common.memory_limits: the memory a process may use, from the host and its cgroups (v1 and v2)."""

from __future__ import annotations

from shardserve.server.common.memory_limits import (
    CgroupMount,
    cgroup_limit,
    cgroup_mounts,
    effective_memory,
    host_memory,
    limit_files,
    own_cgroups,
    parse_limit,
)

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "9:name=systemd:/\n4:memory:/jobs/a1\n1:cpu:/\n0::/\n"
V2_MOUNTINFO = "30 24 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/kubepods/pod7/c1\n"
DOCKER_MOUNTINFO = "30 24 0:26 /docker/abc /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw\n"


def files(mapping: dict[str, str]):  # type: ignore[no-untyped-def]
    return mapping.get


def test_mounts_and_own_cgroups_are_parsed() -> None:
    assert cgroup_mounts(V1_MOUNTINFO) == [
        CgroupMount(1, "/sys/fs/cgroup/memory", "/"),
        CgroupMount(2, "/sys/fs/cgroup/unified", "/"),
    ]
    assert own_cgroups(V1_CGROUP) == {1: "/jobs/a1", 2: "/"}
    assert cgroup_mounts(V2_MOUNTINFO) == [CgroupMount(2, "/sys/fs/cgroup", "/")]


def test_limit_files_walk_up_to_the_mount_root() -> None:
    mount = CgroupMount(2, "/sys/fs/cgroup", "/")
    assert limit_files(mount, "/kubepods/pod7/c1") == [
        "/sys/fs/cgroup/kubepods/pod7/c1/memory.max",
        "/sys/fs/cgroup/kubepods/pod7/memory.max",
        "/sys/fs/cgroup/kubepods/memory.max",
        "/sys/fs/cgroup/memory.max",
    ]
    in_container = CgroupMount(2, "/sys/fs/cgroup", "/docker/abc")
    assert limit_files(in_container, "/docker/abc") == ["/sys/fs/cgroup/memory.max"]
    v1 = CgroupMount(1, "/sys/fs/cgroup/memory", "/")
    assert limit_files(v1, "/jobs/a1")[0] == "/sys/fs/cgroup/memory/jobs/a1/memory.limit_in_bytes"


def test_unlimited_values_are_no_limit() -> None:
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712\n") is None
    assert parse_limit("4294967296\n") == 4 << 30


def test_v1_limit_of_the_process_cgroup() -> None:
    found = cgroup_limit(
        V1_MOUNTINFO,
        V1_CGROUP,
        files(
            {
                "/sys/fs/cgroup/memory/jobs/a1/memory.limit_in_bytes": "4294967296\n",
                "/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": "9223372036854771712\n",
                "/sys/fs/cgroup/unified/memory.max": "max\n",
            }
        ),
    )
    assert found is not None and found.nbytes == 4 << 30
    assert found.source == "cgroup v1 /sys/fs/cgroup/memory/jobs/a1/memory.limit_in_bytes"


def test_v2_takes_the_smallest_limit_along_the_hierarchy() -> None:
    found = cgroup_limit(
        V2_MOUNTINFO,
        V2_CGROUP,
        files(
            {
                "/sys/fs/cgroup/kubepods/pod7/c1/memory.max": "max\n",
                "/sys/fs/cgroup/kubepods/pod7/memory.max": "2147483648\n",
                "/sys/fs/cgroup/kubepods/memory.max": "8589934592\n",
            }
        ),
    )
    assert found is not None and found.nbytes == 2 << 30
    assert found.source == "cgroup v2 /sys/fs/cgroup/kubepods/pod7/memory.max"


def test_no_cgroup_limit_and_unreadable_files_mean_none() -> None:
    assert cgroup_limit(V2_MOUNTINFO, V2_CGROUP, files({})) is None
    assert cgroup_limit("", "", files({})) is None


def test_effective_memory_on_this_machine_is_at_most_the_host() -> None:
    effective, host = effective_memory(), host_memory()
    assert 0 < effective.nbytes <= host.nbytes and effective.source
