"""Shared fixtures: real local clusters (coordinator in-process, ranks as processes), always torn down."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

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
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A self-signed certificate for 127.0.0.1, used as server cert, client cert and CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return TlsFiles(str(d / "cert.pem"), str(d / "key.pem"), str(d / "cert.pem"))
