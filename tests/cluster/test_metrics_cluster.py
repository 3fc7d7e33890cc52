"""Prometheus metrics of a live cluster: a scripted workload moves each named metric by the right amount; the
Grafana dashboard names only metrics the scrape found; `shardserve top` renders in a pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

import shardserve
from shardserve import TensorNotFoundError, connect
from shardserve.client.cli.top import Samples, scrape, total
from shardserve.core import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank_launch import PROJECT_ROOT

ROWS, DIM = 4096, 16
TABLE_BYTES = ROWS * DIM * 4
BOX = ((100, 0), (200, DIM))  # rows 100-299, all on rank 0
SPAN = ((2000, 0), (100, DIM))  # rows 2000-2099: 48 on rank 0, 52 on rank 1
LOOKUP_IDS = torch.tensor([5, 7, 2100, 3000, 4095])  # unique: 2 on rank 0, 3 on rank 1
DASHBOARD = PROJECT_ROOT / "docker" / "grafana" / "dashboards" / "shardserve.json"


@dataclass
class Scrapes:
    """Every process's samples before and after the workload, summed over the processes."""

    before: Samples
    after: Samples
    names: set[str]
    client_before: dict
    client_after: dict

    def moved(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


def metrics_addresses(address: str) -> list[str]:
    """The coordinator's and every rank's metrics address, as ListRanks tells them."""
    with grpc.insecure_channel(address) as channel:
        answer = pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=10)
    return [answer.metrics_address] + [r.metrics_address for r in answer.ranks]


def scrape_all(address: str) -> Samples:
    out: Samples = {}
    for metrics_address in metrics_addresses(address):
        for key, value in scrape(metrics_address).items():
            out[key] = out.get(key, 0.0) + value
    return out


@pytest.fixture(scope="module")
def metrics_cluster(make_cluster) -> LocalCluster:
    return make_cluster(ranks=2, metrics_port=0)


def run_workload(address: str) -> None:
    """Puts, fetches over each data path, lookups, a reshard and an error."""
    table = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)
    with connect(address, transport="grpc") as cluster:
        remote = cluster.put("metered", table, ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
        assert torch.equal(remote.fetch(*SPAN), table[2000:2100])
        rows = remote.lookup(LOOKUP_IDS)
        assert torch.equal(rows, table[LOOKUP_IDS])
        with pytest.raises(TensorNotFoundError):
            cluster.tensor("no-such-tensor")
    with connect(address, transport="bulk") as cluster:
        assert torch.equal(cluster.tensor("metered").fetch(*BOX), table[100:300])
    with connect(address, transport="shm") as cluster:
        assert torch.equal(cluster.tensor("metered").full_tensor(), table)
    with connect(address) as cluster:
        resharded = cluster.tensor("metered").reshard(
            ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])
        )
        assert torch.equal(resharded.full_tensor(), table)


@pytest.fixture(scope="module")
def scrapes(metrics_cluster: LocalCluster) -> Scrapes:
    client_before = shardserve.metrics()
    before = scrape_all(metrics_cluster.address)
    run_workload(metrics_cluster.address)
    after = scrape_all(metrics_cluster.address)
    return Scrapes(before, after, {name for name, _ in after}, client_before, shardserve.metrics())


def test_status_lists_every_process_metrics_address(metrics_cluster: LocalCluster) -> None:
    addresses = metrics_addresses(metrics_cluster.address)
    assert len(addresses) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addresses)
    assert len(set(addresses)) == 3


def test_data_path_bytes_moved_by_what_was_read(scrapes: Scrapes) -> None:
    assert scrapes.moved("shardserve_rank_bytes_written_total", tensor="metered") == TABLE_BYTES
    span_bytes = SPAN[1][0] * DIM * 4
    lookup_bytes = len(LOOKUP_IDS) * DIM * 4
    assert (
        scrapes.moved("shardserve_rank_bytes_served_total", path="grpc", tensor="metered")
        == span_bytes + lookup_bytes
    )
    assert (
        scrapes.moved("shardserve_rank_bytes_served_total", path="bulk", tensor="metered")
        == BOX[1][0] * DIM * 4
    )
    # shm: each shard is handed over whole (mapped), once per OpenShard: the full_tensor read and the reshard
    # check read each map both shards of their version
    assert (
        scrapes.moved("shardserve_rank_bytes_served_total", path="shm", tensor="metered")
        == 2 * TABLE_BYTES
    )


def test_lookups_and_ids_counted_per_shard(scrapes: Scrapes) -> None:
    assert (
        scrapes.moved("shardserve_rank_lookups_total", tensor="metered") == 2
    )  # one item per rank's shard
    assert scrapes.moved("shardserve_rank_lookup_ids_total", tensor="metered") == len(LOOKUP_IDS)


def test_rpc_counts_errors_and_latency(scrapes: Scrapes) -> None:
    assert scrapes.moved("shardserve_rpc_errors_total", method="GetTensor", code="NOT_FOUND") == 1
    assert scrapes.moved("shardserve_rpc_requests_total", method="CommitTensor") == 1
    assert (
        scrapes.moved("shardserve_rpc_requests_total", method="WriteShards") == 2
    )  # one batch per rank
    assert (
        scrapes.moved("shardserve_rpc_requests_total", method="Lookup")
        + scrapes.moved("shardserve_rpc_requests_total", method="LookupSmall")
        == 2
    )
    assert scrapes.moved("shardserve_rpc_latency_seconds_count", method="CommitTensor") == 1
    assert (
        scrapes.moved("shardserve_rpc_latency_seconds_bucket", method="CommitTensor", le="+Inf")
        == 1
    )
    assert scrapes.moved("shardserve_rpc_errors_total", code="INTERNAL") == 0
    assert scrapes.moved("shardserve_rpc_failed_total", method="GetTensor") == 1


def test_error_series_exist_at_zero_before_the_first_error(scrapes: Scrapes) -> None:
    """rate() needs a sample before the first error: every method's error series is there from the start."""
    for method in ("GetTensor", "CreateTensor", "Reshard"):  # coordinator methods
        assert ("shardserve_rpc_failed_total", (("method", method),)) in scrapes.before
        key = ("shardserve_rpc_errors_total", (("code", "ALREADY_EXISTS"), ("method", method)))
        assert key in scrapes.before and scrapes.before[key] == 0
    for method in ("ReadRegion", "Lookup", "WriteShards"):  # rank methods, summed over both ranks
        assert scrapes.before[("shardserve_rpc_failed_total", (("method", method),))] == 0


def test_streams_the_client_closed_after_their_last_message_are_not_errors(
    scrapes: Scrapes,
) -> None:
    """The workload's reshard, checkpoint-like collective jobs and progress streams are closed by their
    callers once the last message arrived (GeneratorExit in the servicer): no process counts an error."""
    assert scrapes.moved("shardserve_rpc_requests_total", method="RunCollective") >= 2
    assert scrapes.moved("shardserve_rpc_errors_total", code="UNKNOWN") == 0
    assert scrapes.moved("shardserve_rpc_errors_total", code="CANCELLED") == 0


def test_reshard_counted_as_a_job_on_the_coordinator_and_each_rank(scrapes: Scrapes) -> None:
    assert scrapes.moved("shardserve_coordinator_jobs_total", kind="reshard", outcome="ok") == 1
    assert scrapes.moved("shardserve_rank_jobs_total", kind="reshard", outcome="ok") == 2
    assert scrapes.moved("shardserve_rank_job_duration_seconds_count", kind="reshard") == 2
    assert total(scrapes.after, "shardserve_coordinator_jobs_in_flight") == 0
    # the bytes a reshard moved, as a counter at 0 from the start: rate() plots progress between scrapes
    assert (
        "shardserve_coordinator_job_bytes_moved_total",
        (("kind", "reshard"),),
    ) in scrapes.before
    assert scrapes.moved("shardserve_coordinator_job_bytes_moved_total", kind="reshard") > 0


def test_gauges_show_ranks_tensors_memory_and_catalog(scrapes: Scrapes) -> None:
    after = scrapes.after
    assert total(after, "shardserve_coordinator_ranks", state="alive") == 2
    assert total(after, "shardserve_coordinator_ranks", state="dead") == 0
    assert total(after, "shardserve_coordinator_tensors", state="ready", health="healthy") == 1
    for rank in ("0", "1"):
        assert total(after, "shardserve_rank_memory_used_bytes", rank=rank) >= TABLE_BYTES // 2
        assert total(after, "shardserve_rank_versions", rank=rank) >= 1
    assert (
        scrapes.moved("shardserve_coordinator_catalog_seconds_count", op="commit") >= 2
    )  # the put, the reshard


def test_client_counters_moved(scrapes: Scrapes) -> None:
    before, after = scrapes.client_before, scrapes.client_after
    for path in ("grpc", "bulk", "shm"):
        assert after["reads"].get(path, 0) > before["reads"].get(path, 0), path
    assert after["read_bytes"]["bulk"] - before["read_bytes"].get("bulk", 0) == BOX[1][0] * DIM * 4
    assert after["lookups"] - before["lookups"] == 1
    assert after["lookup_ids"] - before["lookup_ids"] == len(LOOKUP_IDS)


def test_tensor_labels_are_capped(metrics_cluster: LocalCluster) -> None:
    """Past the cap, new names are reported as `_other` (docs/operations.md#metrics)."""
    from shardserve.server.common.metrics import OTHER_TENSOR, TensorLabels

    labels = TensorLabels(limit=2)
    assert [labels(n) for n in ("a", "b", "c", "a")] == ["a", "b", OTHER_TENSOR, "a"]


def dashboard_metric_names() -> set[str]:
    exprs = [
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel["targets"]
    ]
    return {name for expr in exprs for name in re.findall(r"\bshardserve_[a-z_]+", expr)}


def test_dashboard_references_only_scraped_metrics(scrapes: Scrapes) -> None:
    referenced = dashboard_metric_names()
    assert len(referenced) >= 20
    missing = sorted(referenced - scrapes.names)
    assert not missing, f"the dashboard names metrics no process exposes: {missing}"


def test_prometheus_scrapes_every_compose_process() -> None:
    config = (PROJECT_ROOT / "docker" / "prometheus.yml").read_text()
    compose = (PROJECT_ROOT / "docker" / "compose.yaml").read_text()
    for target in ("coordinator:9400", "rank0:9400", "rank1:9400"):
        assert target in config
    assert compose.count('"--metrics-port", "9400"') == 3


def test_compose_file_validates(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0
    ):
        pytest.skip("docker compose is not installed here")
    result = subprocess.run(
        [
            docker,
            "compose",
            "-f",
            str(PROJECT_ROOT / "docker" / "compose.yaml"),
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"SHARDSERVE_TOKEN": "t", "PATH": "/usr/bin:/bin:/usr/local/bin"},
    )
    assert result.returncode == 0, result.stderr


def test_top_renders_in_a_pseudo_terminal(metrics_cluster: LocalCluster, scrapes: Scrapes) -> None:
    pexpect = pytest.importorskip("pexpect")
    top = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "shardserve",
            "--coordinator",
            metrics_cluster.address,
            "top",
            "--interval",
            "0.5",
            "--iterations",
            "2",
        ],
        cwd=str(PROJECT_ROOT),
        dimensions=(80, 160),
        timeout=60,
        encoding="utf-8",
        env=dict(os.environ, COLUMNS="160", LINES="80"),
    )
    try:
        top.expect(pexpect.EOF)
        screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", top.before)  # colors and cursor moves
    finally:
        top.close(force=True)
    assert top.exitstatus == 0, screen
    for text in (
        "shardserve top: 2 ranks",
        "3 metrics endpoints",
        "metered",
        "p99 ms",
        "Heartbeat",
    ):
        assert text in screen, text
