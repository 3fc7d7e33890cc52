"""Two hosts for real: two network namespaces joined by a veth pair, and a cut link between them.

Namespace A holds the coordinator, rank 0 and the client (tests/cluster/two_host_client.py, driven by JSON lines);
namespace B holds rank 1. Reads, lookups and a reshard cross the link; then the link is down (8-9 s, the checks'
own time, at most CUT_S for each wait): rank 0 keeps serving, reads of rank 1 end by the call's deadline, the
coordinator marks rank 1 dead, a reshard is refused naming it; once the link is back rank 1 heartbeats, is
reconciled with its shards whole, and a reshard across the hosts runs in a new epoch. Needs root and `ip netns`;
skipped otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_processes import server_env

pytestmark = pytest.mark.slow  # a cluster over two network namespaces

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SCRIPT = Path(__file__).with_name("two_host_client.py")
ADDRESS_A, ADDRESS_B = "10.77.0.1", "10.77.0.2"
COORDINATOR = f"{ADDRESS_A}:50051"  # a fresh namespace: every port is free
CALL_TIMEOUT_S = 4.0  # the client's deadline: reads of the cut-off rank must end by it
CUT_S = 15.0  # the longest a wait of the checks made while the link is down may take
RECOVERY_S = (
    2.0 + 1.0
)  # from the coordinator seeing rank 1 alive to a long-lived client's good read (+ heartbeat)
START_S = 90.0


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=20)


class Namespaces:
    """Namespaces A and B, joined by a veth pair, removed (with their links) by remove()."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"ssA{tag}", f"ssB{tag}"
        self.link_a, self.link_b = f"ssvA{tag}", f"ssvB{tag}"

    def create(self) -> None:
        run("ip", "netns", "add", self.a)
        run("ip", "netns", "add", self.b)
        run("ip", "link", "add", self.link_a, "type", "veth", "peer", "name", self.link_b)
        for ns, link, address in (
            (self.a, self.link_a, ADDRESS_A),
            (self.b, self.link_b, ADDRESS_B),
        ):
            run("ip", "link", "set", link, "netns", ns)
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", link)
            run("ip", "-n", ns, "link", "set", link, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")

    def set_link(self, up: bool) -> None:
        run("ip", "-n", self.a, "link", "set", self.link_a, "up" if up else "down")

    def remove(self) -> None:
        for ns in (
            self.a,
            self.b,
        ):  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


class Driver:
    """The client process in namespace A: send a command, get its JSON answer within a bound."""

    def __init__(self, namespace: str, log: Path) -> None:
        self.proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                str(CLIENT_SCRIPT),
                COORDINATOR,
                str(CALL_TIMEOUT_S),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            cwd=ROOT,
        )
        self.log = log
        self.answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.answers.put(line)
        self.answers.put(None)  # the client exited

    def next_answer(self, limit: float) -> dict:
        try:
            line = self.answers.get(timeout=limit)
        except queue.Empty:
            raise AssertionError(f"the client gave no answer within {limit:.0f}s") from None
        if line is None:
            raise AssertionError(f"the client exited: {self.log.read_text()[-3000:]}")
        return json.loads(line)

    def __call__(self, op: str, within: float = 60.0, **args: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.next_answer(within)


def _skip_reason() -> str:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"ssprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if done.returncode:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return ""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Namespaces, Driver]]:
    """The coordinator and rank 0 in namespace A, rank 1 in B, and the client in A; all removed at the end."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("two_hosts")
    namespaces = Namespaces()
    procs: list[subprocess.Popen] = []

    def start(namespace: str, args: list[str], name: str, rank: int | None = None) -> None:
        env = server_env()  # with the cluster secret the servers share
        if rank is not None:
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    sys.executable,
                    "-m",
                    "shardserve.server",
                    *args,
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=(logs / f"{name}.log").open("w"),
            )
        )

    try:
        namespaces.create()
        start(
            namespaces.a,
            [
                "coordinator",
                "--listen",
                COORDINATOR,
                "--store-port",
                "50052",
                "--state-dir",
                str(logs / "state"),
            ],
            "coordinator",
        )
        for rank, (namespace, address) in enumerate(
            ((namespaces.a, ADDRESS_A), (namespaces.b, ADDRESS_B))
        ):
            start(
                namespace,
                ["--coordinator", COORDINATOR, "--listen", f"{address}:0"],
                f"rank{rank}",
                rank,
            )
        driver = Driver(namespaces.a, logs / "client.log")
        procs.append(driver.proc)
        assert driver.next_answer(START_S).get("ready")
        for rank in (0, 1):
            assert driver("wait_alive", within=START_S + 5, rank=rank, alive=True, limit=START_S)[
                "reached"
            ]
        yield namespaces, driver
    finally:
        for proc in procs:  # `ip netns exec` execs the command: these are the processes themselves
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)
        namespaces.remove()


def test_reads_lookups_and_a_reshard_cross_the_hosts(hosts: tuple[Namespaces, Driver]) -> None:
    _, client = hosts
    assert client("same_host")["mapped"] == {
        "0": True,
        "1": False,
    }  # rank 1's namespace is another host
    assert client("put", name="t", seed=1, rows=1000, cols=64)["ok"]
    for transport in ("bulk", "grpc", "auto"):
        checked = client("check", name="t", transport=transport)
        assert checked["equal"] and checked["ranks"] == [0, 1] and checked["dim"] == 0, checked
    assert client("lookup", name="t", ids=[3, 999, 3, 500, 0], transport="bulk")["equal"]
    assert client("lookup", name="t", ids=[998, 1, 501], transport="grpc")["equal"]
    moved = client("reshard", name="t", dim=1)
    assert moved["ok"] and moved["dim"] == 1, moved
    for transport in ("bulk", "grpc"):
        assert client("check", name="t", transport=transport)["equal"]


def test_a_cut_link_and_its_return(hosts: tuple[Namespaces, Driver]) -> None:
    namespaces, client = hosts
    assert client("put", name="c", seed=2, rows=1000, cols=64)[
        "ok"
    ]  # rows 0-499 on rank 0, 500-999 on rank 1
    assert client("update_rows", name="c", ids=[1, 900], seed=3)[
        "ok"
    ]  # acknowledged before the cut
    before = client("check", name="c", transport="bulk")
    assert before["equal"], before
    cut = time.monotonic()
    namespaces.set_link(up=False)
    try:
        rank0 = client("read", name="c", offsets=[0, 0], sizes=[10, 64], transport="bulk")
        assert rank0["ok"] and rank0["equal"], rank0
        rank1 = client("read", name="c", offsets=[990, 0], sizes=[10, 64], transport="bulk")
        assert not rank1["ok"] and rank1["error"] in (
            "DeadlineExceededError",
            "RankUnavailableError",
        ), rank1  # a partitioned rank is UNAVAILABLE, never DATA_LOSS
        assert rank1["seconds"] <= CALL_TIMEOUT_S + 2.0, rank1  # the call's deadline bounds it
        dead = client("wait_alive", within=CUT_S + 5, rank=1, alive=False, limit=CUT_S)
        assert dead["reached"], dead
        down = client("read", name="c", offsets=[990, 0], sizes=[10, 64], transport="grpc")
        assert down["error"] == "RankUnavailableError" and "rank 1" in down["message"], down
        assert down["seconds"] <= CALL_TIMEOUT_S + 2.0, down  # retried until the call's deadline
        assert client("health", name="c")["health"] == "unavailable"
        refused = client("reshard", name="c", dim=1, within=CALL_TIMEOUT_S + 10)
        assert not refused["ok"] and "rank 1" in refused["message"], refused
        assert client("read", name="c", offsets=[0, 0], sizes=[500, 64], transport="grpc")["equal"]
        assert client("lookup", name="c", ids=[1, 2, 499], transport="bulk")["equal"]
        cut_s = time.monotonic() - cut
    finally:
        namespaces.set_link(up=True)
    back = client("wait_alive", within=35.0, rank=1, alive=True, limit=30.0)
    assert back["reached"], back
    for transport in (
        "bulk",
        "grpc",
    ):  # the clients connected since the start read rank 1 again by themselves
        again = client(
            "first_good_read",
            name="c",
            offsets=[990, 0],
            sizes=[10, 64],
            transport=transport,
            limit=RECOVERY_S + 5.0,
        )
        assert again["reached"] and again["after"] <= RECOVERY_S, (transport, again)
        print(
            f"cut link: the {transport} client read rank 1 again {again['after']:.2f} s after it was alive"
        )
    print(
        f"cut link: read of rank 1 failed after {rank1['seconds']}s ({rank1['error']}), rank 1 marked dead "
        f"{dead['seconds'] + rank0['seconds'] + rank1['seconds']:.1f}s after the cut, reshard refused in "
        f"{refused['seconds']}s, link back after {cut_s:.1f}s, rank 1 alive {back['seconds']}s after that"
    )
    health = client("health", name="c")
    assert health["health"] == "healthy" and health["version"] == before["version"], (
        health
    )  # no repair ran
    for transport in ("bulk", "grpc"):
        checked = client("check", name="c", transport=transport)
        assert checked.get("equal"), checked  # the update is still there
    moved = client("reshard", name="c", dim=1)
    assert moved["ok"] and moved["dim"] == 1, moved
    for transport in ("bulk", "grpc"):
        assert client("check", name="c", transport=transport)["equal"]
