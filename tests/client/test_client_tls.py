"""connect() over mutual TLS plus a token, against a real 1-rank cluster started with certificates."""

from __future__ import annotations

import pytest
import torch

from shardserve import AuthenticationError, RankUnavailableError, connect
from shardserve.client.paths.kinds import PathKind
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.auth import Security

pytestmark = pytest.mark.timeout(300)
TOKEN = "tls-token"


@pytest.fixture(scope="module")
def tls_cluster(make_cluster, tls_files):
    return make_cluster(ranks=1, security=Security(token=TOKEN, tls=tls_files))


def test_put_and_fetch_over_mutual_tls(tls_cluster, tls_files):
    source = torch.randn(300, 700)  # ~840 KB: several chunks each way
    with connect(
        tls_cluster.address,
        token=TOKEN,
        tls_ca=tls_files.ca,
        tls_cert=tls_files.cert,
        tls_key=tls_files.key,
        timeout=30,
    ) as cluster:
        remote = cluster.put("secret", source)
        assert torch.equal(remote.full_tensor(), source)
        assert torch.equal(remote[-5:, 3], source[-5:, 3])


def test_bulk_port_over_tls(tls_cluster, tls_files, monkeypatch):
    """A TLS rank serves its bulk port over TLS: auto reads large parts through it, bit for bit, and so does
    transport="bulk"; a client without TLS files cannot read from it (its gRPC is refused first)."""
    source = torch.randn(600, 700)  # 1.6 MiB: over auto's bulk threshold
    credentials = dict(
        token=TOKEN, tls_ca=tls_files.ca, tls_cert=tls_files.cert, tls_key=tls_files.key, timeout=30
    )
    with connect(tls_cluster.address, **credentials) as cluster:
        remote = cluster.put("secret-large", source)
        monkeypatch.setattr(
            cluster.session.paths.path(PathKind.SHARED_MEMORY),
            "host",
            ("elsewhere", "another-boot-id"),
        )  # no shared memory
        assert torch.equal(remote.full_tensor(), source) and remote.last_transport == "bulk"
        stub = cluster.session.channel.shard_server(cluster.session.address_of(0))
        session = stub.OpenBulkSession(
            pb.BulkSessionRequest(), timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert session.tls and session.port > 0
    with connect(tls_cluster.address, transport="bulk", **credentials) as cluster:
        remote = cluster.tensor("secret-large")
        assert (
            torch.equal(remote[100:500, 7:650], source[100:500, 7:650])
            and remote.last_transport == "bulk"
        )
        cluster.delete("secret-large")


def test_tls_without_client_certificate_or_token_is_refused(tls_cluster, tls_files):
    with pytest.raises(
        RankUnavailableError, match="if the cluster wants client certificates"
    ):  # mTLS
        connect(tls_cluster.address, token=TOKEN, tls_ca=tls_files.ca, timeout=10)
    with pytest.raises(
        RankUnavailableError, match="if the cluster serves TLS, pass tls_ca"
    ):  # plaintext to TLS
        connect(tls_cluster.address, token=TOKEN, timeout=10)
    with pytest.raises(AuthenticationError):
        connect(
            tls_cluster.address,
            tls_ca=tls_files.ca,
            tls_cert=tls_files.cert,
            tls_key=tls_files.key,
            timeout=10,
        )
