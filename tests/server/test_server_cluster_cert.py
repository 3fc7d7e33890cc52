"""The cluster's mTLS certificate as the internal credential: an mTLS cluster started with --cluster-cert-name runs
without any cluster secret (ranks register, heartbeat, allocate, reshard and rejoin after kill -9 by certificate
alone), while a user's certificate from the same CA, even with an admin token, gets no internal right."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest
import torch
from certificates import LOOPBACK, Certificates
from server_helpers import TIMEOUT, rpc_error
from server_processes import server_env, spawn_server, stop_all
from waiting import wait_until

from shardserve import AuthenticationError, connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security, TlsFiles
from shardserve.server.common.cli_args import (
    CLUSTER_SECRET_FILE,
    CLUSTER_SECRET_FILE_ENV,
    add_security_args,
    security_from_args,
)
from shardserve.server.common.principals import ClusterCertificate, PrincipalBook, token_sha256
from shardserve.server.launcher import free_port
from shardserve.server.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
CLUSTER_NAME = "shardserve-cluster.internal"
ADMIN_TOKEN = "cluster-cert-admin-token"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
RESTART_WAIT = 120.0


@pytest.fixture(scope="module")
def pki(certificates: Certificates) -> dict[str, TlsFiles]:
    """One CA signing the cluster's certificate (its name among the SANs) and a user's (another CN, same hosts)."""
    ca = certificates.self_signed("pki-ca", "/CN=shardserve test CA")
    return {
        "cluster": certificates.signed(
            "pki-cluster", ca, "/CN=rank-host", f"DNS:{CLUSTER_NAME},{LOOPBACK}"
        ),
        "user": certificates.signed("pki-user", ca, "/CN=alice"),
    }


@pytest.fixture(scope="module")
def cert_cluster(make_cluster, pki, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    tokens.write_text(
        f'[[principal]]\nname = "ops"\ntoken_sha256 = "{token_sha256(ADMIN_TOKEN)}"\n'
        'role = "admin"\n'
    )
    return make_cluster(
        ranks=2,
        security=Security(
            tls=pki["cluster"],
            principals=PrincipalBook(str(tokens)),
            cluster_cert=ClusterCertificate(CLUSTER_NAME),
        ),
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.1),
    )


def _channel(address: str, files: TlsFiles) -> grpc.Channel:
    read = [Path(path).read_bytes() for path in (files.ca, files.key, files.cert)]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(*read))


def _connect(cluster, files: TlsFiles, **kwargs):
    return connect(
        cluster.address,
        tls_ca=files.ca,
        tls_cert=files.cert,
        tls_key=files.key,
        timeout=30,
        **kwargs,
    )


def _listed(cluster, rank: int, files: TlsFiles | None = None) -> pb.RankInfo:
    with _channel(cluster.address, files or cluster.security.tls) as channel:
        ranks = (
            pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
        )
    return next(info for info in ranks if info.rank == rank)


def test_the_cluster_runs_on_its_certificate_alone(cert_cluster, pki):
    """No secret was made: the ranks registered and serve writes and a reshard (collectives) by certificate."""
    assert cert_cluster.security.cluster is None
    assert not (Path(cert_cluster.state_dir) / CLUSTER_SECRET_FILE).exists()
    source = torch.randn(64, 33)
    with _connect(cert_cluster, pki["user"], token=ADMIN_TOKEN) as client:
        remote = client.put("by-cert", source)
        assert torch.equal(remote.full_tensor(), source)
        resharded = remote.reshard(ChunkShardingSpec(1, ["rank:1/cpu", "rank:0/cpu"]))
        assert torch.equal(resharded.full_tensor(), source)


def test_a_user_certificate_gets_no_internal_right(cert_cluster, pki):
    """The user's certificate (same CA) with the admin token: PERMISSION_DENIED on the internal RPCs; without a
    token: UNAUTHENTICATED; the cluster's certificate alone: the internal right."""
    user, cluster = pki["user"], pki["cluster"]
    rank_address = _listed(cert_cluster, 0).address
    internal = [
        lambda stubs, md: stubs[0].Heartbeat(
            pb.HeartbeatRequest(rank=1), timeout=TIMEOUT, metadata=md
        ),
        lambda stubs, md: stubs[0].RegisterRank(
            pb.RegisterRankRequest(rank=pb.RankInfo(rank=1)), timeout=TIMEOUT, metadata=md
        ),
        lambda stubs, md: stubs[1].CancelCollective(
            pb.CancelCollectiveRequest(seq=1 << 40), timeout=TIMEOUT, metadata=md
        ),
        lambda stubs, md: stubs[1].DropVersion(
            pb.DropVersionRequest(name="by-cert"), timeout=TIMEOUT, metadata=md
        ),
    ]
    with _channel(cert_cluster.address, user) as coordinator, _channel(rank_address, user) as rank:
        stubs = (pb_grpc.CoordinatorStub(coordinator), pb_grpc.ShardServerStub(rank))
        for call in internal:
            denied = rpc_error(call, stubs, ADMIN)
            assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "principal 'ops' (role admin) lacks the 'cluster' right" in denied.details()
            unauthenticated = rpc_error(call, stubs, ())
            assert unauthenticated.code() == grpc.StatusCode.UNAUTHENTICATED
    with (
        _channel(cert_cluster.address, cluster) as coordinator,
        _channel(rank_address, cluster) as rank,
    ):
        pb_grpc.CoordinatorStub(coordinator).Heartbeat(pb.HeartbeatRequest(rank=0), timeout=TIMEOUT)
        assert (
            pb_grpc.ShardServerStub(rank).GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).rank == 0
        )
    with pytest.raises(AuthenticationError):
        _connect(cert_cluster, user)


def test_a_killed_rank_rejoins_by_certificate(cert_cluster, pki):
    """kill -9 of rank 1: its restarted process registers and heartbeats with the certificate, and serves again."""
    old_pid = _listed(cert_cluster, 1).pid
    cert_cluster.kill_rank(1)
    wait_until(
        lambda: (
            (info := _listed(cert_cluster, 1)).alive and info.pid != old_pid and info.restarts >= 1
        ),
        RESTART_WAIT,
        "rank 1 to rejoin",
    )
    source = torch.arange(2000, dtype=torch.int64).view(100, 20)
    with _connect(cert_cluster, pki["user"], token=ADMIN_TOKEN) as client:
        remote = client.put("after-restart", source)
        assert torch.equal(remote.full_tensor(), source)


def _security(*flags: str):
    parser = argparse.ArgumentParser()
    add_security_args(parser)
    return security_from_args(parser.parse_args(list(flags)))


def test_cluster_cert_name_is_checked_at_start(pki):
    cluster = pki["cluster"]
    files = ["--tls-cert", cluster.cert, "--tls-key", cluster.key]
    with pytest.raises(ValueError, match="--cluster-cert-name needs mutual TLS"):
        _security("--cluster-cert-name", CLUSTER_NAME, *files)
    with pytest.raises(ValueError, match="--cluster-cert-name 'other' is not a name of --tls-cert"):
        _security("--cluster-cert-name", "other", *files, "--tls-ca", cluster.ca)
    security = _security("--cluster-cert-name", CLUSTER_NAME, *files, "--tls-ca", cluster.ca)
    assert security.call_metadata() == () and security.has_cluster_credential


def test_coordinator_and_node_processes_need_no_secret(tmp_path, pki):
    """`shardserve coordinator` and `shardserve node` (the multi-host commands), with no secret in flags or the
    environment: the node's ranks register by certificate, serve a put bit for bit, and SIGTERM stops them."""
    cluster, user = pki["cluster"], pki["user"]
    tls = [
        "--tls-cert",
        cluster.cert,
        "--tls-key",
        cluster.key,
        "--tls-ca",
        cluster.ca,
        "--cluster-cert-name",
        CLUSTER_NAME,
    ]
    env = {key: value for key, value in server_env().items() if key != CLUSTER_SECRET_FILE_ENV}
    port = free_port()
    procs = []
    with open(tmp_path / "servers.log", "w") as log:
        try:
            procs.append(
                spawn_server(
                    [
                        "coordinator",
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--state-dir",
                        str(tmp_path / "state"),
                        *tls,
                    ],
                    env,
                    log,
                )
            )
            procs.append(
                spawn_server(
                    [
                        "node",
                        "--coordinator",
                        f"127.0.0.1:{port}",
                        "--ranks",
                        "0-1",
                        "--world-size",
                        "2",
                        "--host",
                        "127.0.0.1",
                        *tls,
                    ],
                    env,
                    log,
                )
            )
            address = f"127.0.0.1:{port}"
            wait_until(
                lambda: _alive_ranks(address, cluster) == 2, RESTART_WAIT, "both ranks to register"
            )
            source = torch.randn(40, 7, dtype=torch.float64)
            with connect(
                address, tls_ca=user.ca, tls_cert=user.cert, tls_key=user.key, timeout=30
            ) as client:
                assert torch.equal(client.put("on-nodes", source).full_tensor(), source)
            assert not (tmp_path / "state" / CLUSTER_SECRET_FILE).exists()
        finally:
            stop_all(procs)
    assert [proc.returncode for proc in procs] == [0, 0], (tmp_path / "servers.log").read_text()[
        -3000:
    ]


def _alive_ranks(address: str, files: TlsFiles) -> int:
    with _channel(address, files) as channel:
        ranks = pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=5).ranks
    return sum(info.alive for info in ranks)


@pytest.mark.parametrize(
    "auth_context,matches",
    [
        (
            {
                "transport_security_type": [b"ssl"],
                "x509_pem_cert": [b"PEM"],
                "x509_common_name": [b"rank-host"],
                "x509_subject_alternative_name": [b"localhost", CLUSTER_NAME.encode()],
            },
            True,
        ),
        (
            {
                "transport_security_type": [b"ssl"],
                "x509_pem_cert": [b"PEM"],
                "x509_common_name": [CLUSTER_NAME.encode()],
            },
            True,
        ),
        (
            {
                "transport_security_type": [b"ssl"],
                "x509_pem_cert": [b"PEM"],
                "x509_common_name": [b"alice"],
                "x509_subject_alternative_name": [b"localhost", b"shardserve-cluster"],
            },
            False,
        ),
        (
            {"transport_security_type": [b"ssl"], "x509_common_name": [CLUSTER_NAME.encode()]},
            False,
        ),  # no client cert
        (
            {
                "transport_security_type": [b"insecure"],
                "x509_pem_cert": [b"PEM"],
                "x509_common_name": [CLUSTER_NAME.encode()],
            },
            False,
        ),
        ({}, False),
    ],
)
def test_which_peers_count_as_the_cluster(auth_context, matches):
    assert ClusterCertificate(CLUSTER_NAME).matches(auth_context) is matches
