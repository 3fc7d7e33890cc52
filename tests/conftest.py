"""Shared fixtures: real local clusters (coordinator in-process, ranks as processes), always torn down.

Starting a cluster costs seconds of CPU per rank (each imports torch), so the clusters with default settings,
`cluster2` and `cluster3`, are started once per test process and lent to one module after another: a module
gets them with every rank alive and no tensor, and gives them back with its tensors deleted. A module that
kills ranks or needs other settings starts its own with make_cluster.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

import pytest
from certificates import Certificates
from gloo_world import start_forkserver
from loaded_host import coordinator_options

from shardserve import TensorNotFoundError, connect
from shardserve.server.common.auth import TlsFiles
from shardserve.server.launcher import LocalCluster

# the PostgreSQL server of the catalog's tests: postgres_server (one per test process), postgres_url (a database)
pytest_plugins = ["postgres"]

CLUSTER_START_TIMEOUT = 180.0
START_METHOD = "forkserver"
"""How the test clusters start their ranks: forked from this test process's forkserver (torch imported once),
as `shardserve up` does by default; tests of the other method pass start_method="spawn"."""


@pytest.fixture(scope="module")
def make_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalCluster]]:
    """Factory: make_cluster(**LocalCluster kwargs) starts a cluster that is stopped at module end."""
    clusters: list[LocalCluster] = []

    def factory(**kwargs: object) -> LocalCluster:
        start_forkserver()
        kwargs.setdefault("state_dir", tmp_path_factory.mktemp("state"))
        kwargs.setdefault("start_method", START_METHOD)
        cluster = LocalCluster(**kwargs)  # type: ignore[arg-type]
        clusters.append(cluster)
        return cluster.start(timeout=CLUSTER_START_TIMEOUT)

    yield factory
    for cluster in reversed(clusters):
        cluster.stop()


class SharedClusters:
    """The default-settings clusters of this test process, one per number of ranks, started on first use (their
    metrics served on free ports: a test can count the calls a rank answered; a rank dead after the loaded
    host's silence, loaded_host.SILENCE_S)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._clusters: dict[int, LocalCluster] = {}

    def lend(self, ranks: int) -> LocalCluster:
        """The cluster of `ranks` ranks, every rank alive and no tensor in it (a fresh one if a module broke
        the last one)."""
        cluster = self._clusters.get(ranks)
        if cluster is not None and not _whole(cluster):
            cluster.stop()
            cluster = None
        if cluster is None:
            state = self._tmp_path_factory.mktemp(f"shared{ranks}")
            start_forkserver()
            cluster = LocalCluster(
                ranks,
                state_dir=state,
                metrics_port=0,
                start_method=START_METHOD,
                coordinator_options=coordinator_options(),
            ).start(timeout=CLUSTER_START_TIMEOUT)
            self._clusters[ranks] = cluster
        return cluster

    def stop(self) -> None:
        for cluster in self._clusters.values():
            cluster.stop()


def _whole(cluster: LocalCluster) -> bool:
    """Whether every rank of `cluster` is alive and its catalog holds no tensor."""
    with connect(cluster.address, timeout=30) as client:
        alive = all(rank.alive for rank in client.ranks())
        return alive and not client.list(include_pending=True)


def _forget_tensors(cluster: LocalCluster) -> None:
    """Delete every tensor of `cluster` (what a module put), pending ones included."""
    with connect(cluster.address, timeout=30) as client:
        for summary in client.list(include_pending=True):
            with contextlib.suppress(TensorNotFoundError):
                client.delete(summary.name)


@pytest.fixture(scope="session")
def shared_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedClusters]:
    """The clusters cluster2 and cluster3 lend, stopped at the end of the session."""
    clusters = SharedClusters(tmp_path_factory)
    yield clusters
    clusters.stop()


@pytest.fixture(scope="module")
def cluster2(shared_clusters: SharedClusters) -> Iterator[LocalCluster]:
    """A 2-rank CPU cluster without a token, lent to this module (empty at its start, emptied at its end)."""
    cluster = shared_clusters.lend(2)
    yield cluster
    _forget_tensors(cluster)


@pytest.fixture(scope="module")
def cluster3(shared_clusters: SharedClusters) -> Iterator[LocalCluster]:
    """A 3-rank CPU cluster without a token, lent to this module (empty at its start, emptied at its end)."""
    cluster = shared_clusters.lend(3)
    yield cluster
    _forget_tensors(cluster)


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


SLOW_FIXTURES = frozenset({"make_cluster", "runs"})
"""Fixtures that make a test slow: a cluster of its own (make_cluster) or a benchmark scenario's run (runs)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that uses a fixture of SLOW_FIXTURES (tests that spawn server or client
    processes otherwise carry the mark themselves), so that `-m "not slow"` is the quick loop."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
