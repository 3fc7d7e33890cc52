"""`shardserve up` inside a real memory cgroup: the ranks' default limits come from the cgroup (not the host),
`status` says so, and a create larger than the cgroup can hold is RESOURCE_EXHAUSTED while every process stays
alive. Needs root and a writable memory cgroup (v1 or v2); skipped otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_processes import server_env

from shardserve import Cluster, ResourceExhaustedError, connect
from shardserve.client.cli.main import main as cli_main
from shardserve.protos.errors import Reason
from shardserve.server.common.memory_limits import cgroup_mounts, limit_files, own_cgroups
from shardserve.server.launcher import free_port
from shardserve.server.rank.memory_budget import default_memory_limit

pytestmark = pytest.mark.slow  # `up` in a memory cgroup

LIMIT = (
    3 << 30
)  # the cgroup's memory limit: smaller than this 24 GiB host, larger than 2 ranks need to start
START_TIMEOUT = 180.0


def child_cgroup() -> tuple[Path, Path, str] | None:
    """A new child of this process's memory cgroup: (its folder, its limit file, its procs file), or None."""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    own = own_cgroups(Path("/proc/self/cgroup").read_text())
    for mount in sorted(cgroup_mounts(mountinfo), key=lambda m: m.version):
        path = own.get(mount.version)
        if path is None:
            continue
        own_limit = Path(limit_files(mount, path)[0])
        parent, limit = own_limit.parent, own_limit.name
        if mount.version == 2 and "memory" not in _text(parent / "cgroup.subtree_control"):
            continue
        folder = parent / f"shardserve-test-{os.getpid()}"
        try:
            folder.mkdir()
        except OSError:
            continue
        return folder, folder / limit, str(folder / "cgroup.procs")
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def cgroup() -> Iterator[tuple[Path, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    made = child_cgroup()
    if made is None:
        pytest.skip("no writable memory cgroup on this machine")
    folder, limit_file, procs = made
    try:
        limit_file.write_text(str(LIMIT))
        yield folder, procs
    finally:
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except OSError:  # processes still leaving it
                time.sleep(0.2)


def test_up_in_a_memory_cgroup_takes_its_limit_and_refuses_what_does_not_fit(
    cgroup, tmp_path, capsys
):
    folder, procs = cgroup
    port = free_port()

    def enter_cgroup() -> (
        None
    ):  # in the child, before exec: `up` and every rank it starts live in it
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    up = subprocess.Popen(
        [sys.executable, "-m", "shardserve.server", "up", "--ranks", "2", "--port", str(port)],
        cwd=tmp_path,
        env=server_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=enter_cgroup,
    )
    address = f"127.0.0.1:{port}"
    try:
        client = _connect_when_up(address, up)
        with client:
            ranks = client.ranks()
            share = default_memory_limit("cpu", LIMIT, 2)
            assert [r.memory_limit_bytes for r in ranks] == [share, share]
            assert all("cgroup v" in r.memory_limit_source for r in ranks), ranks[
                0
            ].memory_limit_source
            assert all(str(folder) in r.memory_limit_source for r in ranks)
            rows = (2 * share) // (1024 * 4) + 1024  # more than both ranks may hold together
            with pytest.raises(ResourceExhaustedError) as refused:
                client.create("too-big", (rows, 1024), torch.float32, init="zeros")
            assert refused.value.reason == Reason.MEMORY_LIMIT
            fits = client.create("fits", (4096, 1024), torch.float32, init="ones")
            assert torch.equal(fits[4000:4096], torch.ones(96, 1024))
            assert up.poll() is None and all(r.alive for r in client.ranks())
            assert "too-big" not in {t.name for t in client.list()}
        assert cli_main(["--coordinator", address, "status"]) == 0
        assert "cgroup v" in capsys.readouterr().out
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(timeout=30)


def _connect_when_up(address: str, up: subprocess.Popen) -> Cluster:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert up.poll() is None, "up exited"
        try:
            client = connect(address, timeout=10)
        except Exception:  # noqa: BLE001 - not serving yet
            time.sleep(0.5)
            continue
        if len(client.ranks()) == 2 and all(r.alive for r in client.ranks()):
            return client
        client.close()
        time.sleep(0.5)
    raise AssertionError("the cluster did not come up in time")
