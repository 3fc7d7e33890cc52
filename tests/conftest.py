"""Shared fixtures: real local clusters (coordinator in-process, ranks as processes), always torn down."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest
from certificates import Certificates

from shardserve.server.common.auth import TlsFiles
from shardserve.server.launcher import LocalCluster

CLUSTER_START_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalCluster]]:
    """Factory: make_cluster(**LocalCluster kwargs) starts a cluster that is stopped at module end."""
    clusters: list[LocalCluster] = []

    def factory(**kwargs: object) -> LocalCluster:
        kwargs.setdefault("state_dir", tmp_path_factory.mktemp("state"))
        cluster = LocalCluster(**kwargs)  # type: ignore[arg-type]
        clusters.append(cluster)
        return cluster.start(timeout=CLUSTER_START_TIMEOUT)

    yield factory
    for cluster in reversed(clusters):
        cluster.stop()


@pytest.fixture(scope="module")
def cluster3(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """A 3-rank CPU cluster without a token, shared by a test module."""
    return make_cluster(ranks=3)


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """The maker of the session's test certificates (skips the test without the openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    return Certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def tls_files(certificates: Certificates) -> TlsFiles:
    """A self-signed certificate for 127.0.0.1, used as server cert, client cert and CA."""
    return certificates.self_signed("cluster")
