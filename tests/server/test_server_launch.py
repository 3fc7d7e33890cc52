"""Launching: `python -m shardserve.server up` as a process, signals, dead ranks, `coordinator` + torchrun, restarts,
`shardserve node` (its ranks restarted one by one, all stopped by SIGTERM)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import TIMEOUT, Stubs, create, put, read_full, rpc_error
from server_processes import server_env
from waiting import wait_until

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.coordinator_process import CoordinatorOptions
from shardserve.server.launcher import free_port

pytestmark = pytest.mark.slow  # spawns coordinator, node and rank processes

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 180.0
SHARDSERVE = str(Path(sys.executable).with_name("shardserve"))


def spawn(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, queue.Queue[str]]:
    env = server_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve.server", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def coordinator_line(proc: subprocess.Popen, lines: queue.Queue[str]) -> str:
    try:
        line = lines.get(timeout=START_TIMEOUT)
    except queue.Empty:
        proc.kill()
        raise AssertionError("no 'coordinator: HOST:PORT' line in time") from None
    match = re.fullmatch(r"coordinator: (127\.0\.0\.1:\d+)\n", line)
    assert match, line
    return match.group(1)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def rank_pids(address: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        ranks = (
            pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
        )
    return [r.pid for r in ranks if r.alive]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_up_prints_the_address_and_sigterm_stops_every_child(tmp_path, method):
    proc, lines = spawn(
        ["up", "--ranks", "2", "--state-dir", str(tmp_path / "state"), "--start-method", method],
        tmp_path,
    )
    try:
        address = coordinator_line(proc, lines)
        pids = rank_pids(address)
        assert len(pids) == 2 and all(not gone(p) for p in pids)
        parents = {
            int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids
        }
        # forked ranks are children of up's forkserver, spawned ones of up itself
        assert (parents == {proc.pid}) == (method == "spawn"), (parents, proc.pid)
        assert (tmp_path / "state" / "catalog.sqlite").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: all(gone(p) for p in pids), 10, "rank processes to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_exit_when_the_launcher_is_killed(tmp_path, method):
    proc, lines = spawn(
        ["up", "--ranks", "1", "--state-dir", str(tmp_path / "state"), "--start-method", method],
        tmp_path,
    )
    try:
        pids = rank_pids(coordinator_line(proc, lines))
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: all(gone(p) for p in pids), 45, "orphaned ranks to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def meta_on(ranks, size=(6, 4)):
    return ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        size, TensorProperties(dtype=torch.float32)
    )


def alive(stubs: Stubs) -> dict[int, bool]:
    return {
        r.rank: r.alive for r in stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
    }


@pytest.fixture(scope="module")
def watched(make_cluster):
    return make_cluster(
        ranks=2,
        coordinator_options=CoordinatorOptions(heartbeat_interval=0.3, pending_timeout=1.0),
    )


def test_a_put_left_pending_is_aborted_after_the_timeout(watched):
    stubs = Stubs(watched.address)
    try:
        info = create(stubs, "forgotten", meta_on([0]))
        assert info.state == pb.PENDING

        def listed():
            return stubs.coord.ListTensors(
                pb.ListTensorsRequest(include_pending=True), timeout=TIMEOUT
            ).tensors

        assert "forgotten" in [t.name for t in listed()]
        wait_until(
            lambda: "forgotten" not in [t.name for t in listed()],
            20,
            "the pending put to be reaped",
        )

        def held():  # the catalog row goes first, then the rank drops the shards
            return {
                (h.name, h.version)
                for h in stubs.ranks[0].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).held
            }

        wait_until(
            lambda: ("forgotten", info.version) not in held(),
            10,
            "rank 0 to drop the pending shards",
        )
    finally:
        stubs.close()


def test_missed_heartbeats_mark_a_rank_dead_and_the_others_keep_serving(watched):
    cluster = watched
    stubs = Stubs(cluster.address)
    try:
        tensor = torch.randn(6, 4)
        info = put(stubs, "on0", tensor, meta_on([0]))
        spread = put(stubs, "spread", tensor, meta_on([0, 1]))
        cluster.kill_rank(1, signal.SIGSTOP)  # alive as a process, silent as a rank
        try:
            assert _thread_states(cluster.rank_pids[1]) == {"T"}  # every thread stopped already
            wait_until(lambda: alive(stubs) == {0: True, 1: False}, 15, "rank 1 to be marked dead")
            err = rpc_error(create, stubs, "on1", meta_on([1]))
            assert (
                err.code() == grpc.StatusCode.UNAVAILABLE and "rank 1 is not alive" in err.details()
            )
            stubs.coord.DeleteTensor(
                pb.DeleteTensorRequest(name="spread"), timeout=5
            )  # rank 1 is skipped
        finally:
            cluster.kill_rank(1, signal.SIGCONT)
        wait_until(lambda: alive(stubs) == {0: True, 1: True}, 15, "rank 1 to be alive again")

        def held_by_1():
            return {
                (h.name, h.version)
                for h in stubs.ranks[1].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).held
            }

        wait_until(
            lambda: ("spread", spread.version) not in held_by_1(),
            15,
            "rank 1 to drop the deleted tensor",
        )
        cluster.kill_rank(1, signal.SIGKILL)
        wait_until(
            lambda: alive(stubs) == {0: True, 1: False}, 15, "killed rank 1 to be marked dead"
        )
        assert torch.equal(read_full(stubs, info), tensor)
    finally:
        stubs.close()


def test_coordinator_alone_with_a_torchrun_rank_survives_a_coordinator_restart(tmp_path):
    port = free_port()
    state = str(tmp_path / "state")
    coordinator_args = [
        "coordinator",
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        state,
        "--heartbeat-interval",
        "0.3",
    ]
    coord, lines = spawn(coordinator_args, tmp_path)
    env = server_env()
    torchrun = [  # --standalone: its rendezvous store binds a port of its own choosing (a free port picked
        # here could be taken by another test's process before torchrun binds it: EADDRINUSE)
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "shardserve.server",
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    rank = subprocess.Popen(torchrun, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    stubs = None
    try:
        address = coordinator_line(coord, lines)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            wait_until(
                lambda: _registered_while_running(stub, rank),
                START_TIMEOUT,
                "the torchrun rank to register",
            )
        stubs = Stubs(address)
        tensor = torch.randn(6, 4)
        put(stubs, "kept", tensor, meta_on([0]))
        coord.send_signal(signal.SIGTERM)
        assert coord.wait(timeout=30) == 0
        coord, lines = spawn(coordinator_args, tmp_path)  # same port, same catalog
        assert coordinator_line(coord, lines) == address
        wait_until(lambda: alive(stubs) == {0: True}, 30, "the rank to register again")
        info = stubs.coord.GetTensor(pb.GetTensorRequest(name="kept"), timeout=TIMEOUT)
        assert torch.equal(read_full(stubs, info), tensor)
    finally:
        if stubs is not None:
            stubs.close()
        for proc in (rank, coord):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (rank, coord):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _registered_while_running(stub: pb_grpc.CoordinatorStub, rank: subprocess.Popen) -> bool:
    """Whether one rank is registered; an AssertionError at once when `rank`'s launcher has exited."""
    code = rank.poll()
    assert code is None, f"torchrun exited with {code} before its rank registered"
    return len(stub.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["up", "--ranks", "0"], "--ranks must be >= 1"),
        (["up", "--memory-limit", "-1"], "--memory-limit must be >= 0"),
        (["up", "--recycle-bytes", "-1"], "--recycle-bytes must be >= 0"),
        (["up", "--port", "70000"], "--port 70000 is not a TCP port"),
        (["up", "--host", ""], "--host is empty"),
        (["up", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (
            ["node", "--coordinator", "127.0.0.1:1", "--ranks", "0,4", "--world-size", "4"],
            "rank 4 is not below --world-size 4",
        ),
        (["--coordinator", "127.0.0.1:1", "--recycle-bytes", "-5"], "--recycle-bytes must be >= 0"),
        (["--coordinator", "127.0.0.1:1", "--bulk-port", "-1"], "--bulk-port must be >= 0"),
        (
            ["--coordinator", "127.0.0.1:1", "--dist-timeout", "0"],
            "--dist-timeout must be a number of seconds > 0",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--register-timeout", "inf"],
            "--register-timeout must be a number",
        ),
        (["up", "--tls-cert", "c.pem"], "--tls-cert and --tls-key must be given together"),
        (
            ["coordinator", "--tls-cert", "missing.pem", "--tls-key", "k.pem"],
            "tls cert file 'missing.pem' does not exist",
        ),
        (
            ["coordinator", "--catalog", "mysql://u:pw@h/db"],
            "--catalog: catalog 'mysql://u@h/db': mysql:// is not a catalog store",
        ),
        (["up", "--catalog", ""], "--catalog: the catalog's location is empty"),
    ],
)
def test_bad_flags_are_usage_errors(tmp_path, monkeypatch, capsys, args, message):
    """Checked by the entry point `python -m shardserve.server` runs, in this process (a new interpreter per
    case would spend seconds importing torch; the command as users run it is checked below)."""
    assert _usage_error(args, tmp_path, monkeypatch, capsys, server_env()) == 2
    assert message in capsys.readouterr().err


def _usage_error(args, tmp_path, monkeypatch, capsys, env: dict[str, str]) -> object:
    """The exit code of `python -m shardserve.server *args` run in this process from `tmp_path` with `env`,
    which must exit before it starts anything."""
    from shardserve.server.__main__ import main

    monkeypatch.chdir(tmp_path)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code


def test_a_bad_flag_is_a_usage_error_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "up", "--ranks", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=60,
    )
    assert result.returncode == 2
    assert "--ranks must be >= 1" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["node", "--coordinator", "127.0.0.1:1", "--ranks", "0", "--world-size", "1"],
            "--cluster-secret-file is required",
        ),
        (["--coordinator", "127.0.0.1:1"], "no cluster credential: pass --cluster-secret-file"),
    ],
)
def test_ranks_need_the_cluster_secret(tmp_path, args, message):
    env = {k: v for k, v in server_env().items() if k != "SHARDSERVE_CLUSTER_SECRET_FILE"}
    result = subprocess.run(
        [sys.executable, "-m", "shardserve.server", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_coordinator_alone_keeps_its_catalog_in_postgresql(
    tmp_path, postgres_server, postgres_url
):
    """`coordinator --catalog postgresql://...`: it answers from the database (a row written there by another
    catalog shows in its listing), logs the URL without its password, and stops cleanly."""
    from shardserve.core.metadata import ShardedTensorMetadata
    from shardserve.server.coordinator.catalog.locations import open_catalog
    from shardserve.server.coordinator.catalog.records import TensorRecord, TensorState

    log = (tmp_path / "stderr").open("w")
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "shardserve.server", "coordinator", "--listen", "127.0.0.1:0"]
        + ["--state-dir", str(tmp_path / "state"), "--catalog", postgres_url],
        cwd=tmp_path,
        env=server_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in coordinator.stdout], daemon=True
        ).start()
        address = coordinator_line(coordinator, lines)
        beside = open_catalog(postgres_url)
        beside.add(TensorRecord("row", 7, ShardedTensorMetadata(size=(2,)), TensorState.READY))
        beside.close()
        with grpc.insecure_channel(address) as channel:
            listed = pb_grpc.CoordinatorStub(channel).ListTensors(
                pb.ListTensorsRequest(), timeout=TIMEOUT
            )
        assert [(t.name, t.version) for t in listed.tensors] == [("row", 7)]
        assert not (tmp_path / "state" / "catalog.sqlite").exists()
    finally:
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 0
        log.close()
    logged = (tmp_path / "stderr").read_text()
    assert postgres_url.replace(f":{postgres_server.password}@", "@") in logged
    assert postgres_server.password not in logged


def test_a_coordinator_whose_database_cannot_be_reached_says_so_without_the_password(
    tmp_path, postgres_server
):
    unreachable = postgres_server.url("postgres").replace(f":{postgres_server.port}/", ":1/")
    unreachable += (
        "?connect_timeout=2"  # libpq's parameter: the coordinator gives up after 2 s, not 5
    )
    result = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "coordinator", "--listen", "127.0.0.1:0"]
        + ["--state-dir", str(tmp_path), "--catalog", unreachable],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert result.returncode == 1
    assert (
        "the coordinator could not start: catalog postgresql://shardserve@127.0.0.1:1/postgres"
        in (result.stderr)
    )
    assert postgres_server.password not in result.stdout + result.stderr


def test_a_rank_without_a_coordinator_says_so_in_one_line(tmp_path):
    """No coordinator at the address: after --register-timeout the rank exits 1 with one error line that names
    the address and the flag, not a traceback."""
    address = f"127.0.0.1:{free_port()}"
    env = server_env(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "--coordinator",
            address,
            "--register-timeout",
            "0.5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        f"could not register with the coordinator at {address} within --register-timeout 0.5s: UNAVAILABLE"
        in result.stderr
    )


def test_a_link_that_never_registered_stops_cleanly():
    """A rank whose registration failed (a wrong token, no coordinator) shuts down without a second error
    hiding the first: the heartbeat thread was never started."""
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.server.common.auth import Security
    from shardserve.server.rank.coordinator_link import CoordinatorLink
    from shardserve.server.rank.coordinators import Coordinators
    from shardserve.server.rank.store import ShardStore

    link = CoordinatorLink(
        Coordinators(["127.0.0.1:1"], Security()),
        pb.RankInfo(rank=0),
        ShardStore(0, shared_memory=False),
    )
    link.stop()  # raised "cannot join thread before it is started" before the fix
    assert link.stopped


def live_ranks(stub: pb_grpc.CoordinatorStub) -> dict[int, pb.RankInfo]:
    return {
        r.rank: r for r in stub.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks if r.alive
    }


def test_node_restarts_a_killed_rank_and_sigterm_stops_them_all(tmp_path):
    """Against `coordinator` as a process, which learns of the death from missed heartbeats only: the new
    process registers once the old one is known dead, and is counted as a restart."""
    port = free_port()
    coord, lines = spawn(
        [
            "coordinator",
            "--listen",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(tmp_path / "state"),
            "--heartbeat-interval",
            "0.3",
        ],
        tmp_path,
    )
    node = subprocess.Popen(
        [
            SHARDSERVE,
            "node",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--ranks",
            "0-1",
            "--world-size",
            "2",
            "--host",
            "127.0.0.1",
            "--restart-backoff",
            "0.2",
        ],
        cwd=tmp_path,
        env=server_env(),
        stdin=subprocess.DEVNULL,
    )
    pids: set[int] = set()
    try:
        address = coordinator_line(coord, lines)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            wait_until(
                lambda: len(live_ranks(stub)) == 2,
                START_TIMEOUT,
                "both ranks of the node to register",
            )
            first = live_ranks(stub)
            pids |= {r.pid for r in first.values()}
            os.kill(first[1].pid, signal.SIGKILL)

            def back() -> bool:
                rank1 = live_ranks(stub).get(1)
                return rank1 is not None and rank1.pid != first[1].pid

            wait_until(back, START_TIMEOUT, "rank 1 to come back with a new process")
            again = live_ranks(stub)
            assert again[1].restarts == 1 and again[1].address != first[1].address
            assert (again[0].pid, again[0].restarts) == (first[0].pid, 0)
            pids.add(again[1].pid)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
        wait_until(lambda: all(gone(p) for p in pids), 10, "every rank process of the node to exit")
    finally:
        for proc in (node, coord):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (node, coord):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def test_a_cluster_whose_chosen_port_is_taken_before_it_binds_starts_on_another(
    tmp_path, monkeypatch
):
    """port=0: the port chosen free can be bound by another process before the coordinator binds it (the ranks
    were told it already); the cluster stops those ranks and starts again on another port."""
    import socket

    import shardserve.server.launcher as launcher
    from shardserve import connect

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    chosen = iter([taken.getsockname()[1]])
    real = launcher.free_port
    monkeypatch.setattr(
        launcher, "free_port", lambda host="127.0.0.1": next(chosen, None) or real(host)
    )
    try:
        with launcher.LocalCluster(1, state_dir=tmp_path) as cluster:
            assert cluster.address != f"127.0.0.1:{taken.getsockname()[1]}"
            with connect(cluster.address) as client:
                client.put("after-retry", torch.arange(4.0))
                assert torch.equal(client.tensor("after-retry").full_tensor(), torch.arange(4.0))
    finally:
        taken.close()


def _thread_states(pid: int) -> set[str]:
    """The scheduler state letters of every thread of process `pid` (/proc/PID/task/*/stat)."""
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            states.add(stat.read().rpartition(")")[2].split()[0])
    return states
