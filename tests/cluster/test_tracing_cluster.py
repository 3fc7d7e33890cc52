"""OpenTelemetry tracing of a live cluster: a client's reshard is one trace across the client, the coordinator,
every rank's RPCs and the collective job each rank ran; with tracing off nothing is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardserve import connect
from shardserve.core import ChunkShardingSpec
from shardserve.server.common import tracing
from shardserve.server.common.auth import Security
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank_launch import PROJECT_ROOT, rank_launches

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

RANKS = 2
SHARD_SERVER = "/shardserve.v1.ShardServer/"
RESHARD = "/shardserve.v1.Coordinator/Reshard"
SPAN_WAIT_S = (
    30.0  # bound on waiting for a rank's spans to reach its file (written as each span ends)
)


@pytest.fixture(scope="module")
def span_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans")


@pytest.fixture(scope="module")
def traced_cluster(make_cluster, span_dir: Path) -> LocalCluster:
    return make_cluster(ranks=RANKS, rank_options=RankOptions(tracing=f"file:{span_dir}"))


def read_spans(span_dir: Path, service: str) -> list[dict]:
    """Every span the process(es) named `service` wrote, as OpenTelemetry's JSON."""
    return [
        json.loads(line)
        for path in sorted(span_dir.glob(f"{service}-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def spans_of_trace(span_dir: Path, service: str, trace_id: str, wanted: set[str]) -> list[dict]:
    """The spans of `trace_id` written by `service`, waiting (bounded) until every name in `wanted` is there:
    a server span ends, and is written, just after its last message went out."""
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        spans = [s for s in read_spans(span_dir, service) if s["context"]["trace_id"] == trace_id]
        if wanted <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_reshard_is_one_trace_across_client_coordinator_and_ranks(
    traced_cluster: LocalCluster, span_dir: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    table = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    with connect(traced_cluster.address, transport="grpc", tracing=provider) as cluster:
        remote = cluster.put("traced", table, ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
        with provider.get_tracer("test").start_as_current_span("user reshard") as root:
            moved = remote.reshard(ChunkShardingSpec(1, ["rank:1/cpu", "rank:0/cpu"]))
        assert torch.equal(moved.fetch((0, 0), (64, 8)), table)
    trace_id = f"0x{root.get_span_context().trace_id:032x}"

    client_spans = [
        s
        for s in exporter.get_finished_spans()
        if s.context.trace_id == root.get_span_context().trace_id
    ]
    assert [s.name for s in client_spans if s.kind.name == "CLIENT"] == [RESHARD]
    reshard_call = next(s for s in client_spans if s.name == RESHARD)
    assert reshard_call.parent.span_id == root.get_span_context().span_id

    coordinator = spans_of_trace(span_dir, "shardserve-coordinator", trace_id, {RESHARD})
    served = [s for s in coordinator if s["name"] == RESHARD and s["kind"] == "SpanKind.SERVER"]
    assert len(served) == 1 and served[0]["parent_id"] == f"0x{reshard_call.context.span_id:016x}"
    assert not any(
        s["name"].endswith("/Heartbeat") for s in read_spans(span_dir, "shardserve-coordinator")
    )
    to_ranks = {s["name"] for s in coordinator if s["kind"] == "SpanKind.CLIENT"}
    assert {SHARD_SERVER + "RunCollective", SHARD_SERVER + "PromoteVersion"} <= to_ranks

    for rank in range(RANKS):
        wanted = {
            SHARD_SERVER + "RunCollective",
            SHARD_SERVER + "PromoteVersion",
            "collective reshard",
        }
        spans = spans_of_trace(span_dir, f"shardserve-rank-{rank}", trace_id, wanted)
        assert wanted <= {s["name"] for s in spans}, (
            f"rank {rank} wrote {sorted(s['name'] for s in spans)}"
        )
        assert all(
            s["resource"]["attributes"]["service.name"] == f"shardserve-rank-{rank}" for s in spans
        )
        run = next(s for s in spans if s["name"] == SHARD_SERVER + "RunCollective")
        job = next(s for s in spans if s["name"] == "collective reshard")
        assert (
            job["parent_id"] == run["context"]["span_id"]
        )  # the job's own thread continues the call's trace
        assert job["attributes"]["shardserve.rank"] == rank
        assert run["parent_id"] in {s["context"]["span_id"] for s in coordinator}


def test_lookups_without_a_trace_start_their_own(
    traced_cluster: LocalCluster, span_dir: Path
) -> None:
    """A client with tracing off still reaches a traced cluster, whose ranks then start a trace per call."""
    table = torch.randn(32, 4)
    with connect(traced_cluster.address, transport="grpc", tracing=False) as cluster:
        assert cluster.session.channel.interceptor is None
        remote = cluster.put("untraced-client", table)
        ids = torch.tensor([3, 31, 0, 3])
        assert torch.equal(remote.lookup(ids), table[ids])


def test_tracing_off_installs_nothing(tmp_path: Path) -> None:
    """A cluster and client started with tracing off (the default) import no OpenTelemetry module anywhere in
    the coordinator and client process, wrap no channel, and write no span."""
    script = f"""
import sys, torch
from shardserve import connect
from shardserve.server.common import tracing
from shardserve.server.launcher import LocalCluster
with LocalCluster(ranks=1, state_dir={str(tmp_path / "state")!r}) as local:
    with connect(local.address, transport="grpc") as cluster:
        table = torch.randn(16, 4)
        assert torch.equal(cluster.put("plain", table).fetch((0, 0), (16, 4)), table)
        assert cluster.session.channel.interceptor is None
        assert not tracing.tracing_enabled() and tracing.server_interceptors() == []
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("untraced ok")
"""
    env = {k: v for k, v in os.environ.items() if k != tracing.TRACING_ENV}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "untraced ok" in done.stdout


def test_bad_exporter_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--tracing 'zipkin'"):
        LocalCluster(ranks=1, rank_options=RankOptions(tracing="zipkin"))
    with pytest.raises(ValueError, match="tracing must be"):
        connect("127.0.0.1:1", tracing="yes")
    rank = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "--coordinator",
            "127.0.0.1:1",
            "--tracing",
            "file:",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rank.returncode == 2 and "--tracing 'file:'" in rank.stderr


def test_node_hands_tracing_to_its_ranks() -> None:
    options = RankOptions(tracing="file:/spans")
    launches = rank_launches("127.0.0.1:1", options, Security(), ranks=[2, 3], world_size=4)
    assert [list(launch.command[-2:]) for launch in launches] == [["--tracing", "file:/spans"]] * 2
