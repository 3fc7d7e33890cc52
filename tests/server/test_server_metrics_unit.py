"""server.common.metrics without processes: a stream its caller closes early is no error, every method's
series exist at 0 from the start, and a gauge collector reads its state at scrapes only."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shardserve.server.common.metrics import Gauge, GaugeCollector, ServerMetrics, _timed


class Context:
    """The part of a servicer context the metrics wrapper reads."""

    def __init__(self) -> None:
        self.status: grpc.StatusCode | None = None

    def code(self) -> grpc.StatusCode | None:
        return self.status


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def streamed(metrics: ServerMetrics, method: str, messages: int):  # type: ignore[no-untyped-def]
    def answer(request, context):  # type: ignore[no-untyped-def]
        yield from range(messages)

    handler = _timed(grpc.unary_stream_rpc_method_handler(answer), method, metrics)
    return handler.unary_stream(None, Context())


def test_a_stream_closed_by_its_caller_counts_as_a_call_not_an_error() -> None:
    metrics = ServerMetrics("rank")
    stream = streamed(metrics, "RunCollective", 3)
    assert next(stream) == 0
    stream.close()  # what grpc does when the client cancels after the message it wanted
    got = samples(metrics)
    assert got[("shardserve_rpc_requests_total", (("method", "RunCollective"),))] == 1
    assert got[("shardserve_rpc_failed_total", (("method", "RunCollective"),))] == 0
    assert not [k for k, v in got.items() if k[0] == "shardserve_rpc_errors_total" and v]


def test_a_stream_that_raises_counts_as_an_error() -> None:
    metrics = ServerMetrics("rank")

    def failing(request, context):  # type: ignore[no-untyped-def]
        yield 1
        raise RuntimeError("boom")

    handler = _timed(grpc.unary_stream_rpc_method_handler(failing), "RunCollective", metrics)
    with pytest.raises(RuntimeError):
        list(handler.unary_stream(None, Context()))
    got = samples(metrics)
    assert (
        got[("shardserve_rpc_errors_total", (("code", "UNKNOWN"), ("method", "RunCollective")))]
        == 1
    )
    assert got[("shardserve_rpc_failed_total", (("method", "RunCollective"),))] == 1


@pytest.mark.parametrize("role, method", [("coordinator", "CreateTensor"), ("rank", "ReadRegion")])
def test_every_method_has_its_error_series_at_zero_from_the_start(role: str, method: str) -> None:
    got = samples(ServerMetrics(role))
    assert got[("shardserve_rpc_requests_total", (("method", method),))] == 0
    assert got[("shardserve_rpc_failed_total", (("method", method),))] == 0
    for code in ("NOT_FOUND", "ALREADY_EXISTS", "INVALID_ARGUMENT", "UNAVAILABLE"):
        assert got[("shardserve_rpc_errors_total", (("code", code), ("method", method)))] == 0


def test_a_gauge_collector_reads_its_state_at_each_scrape_and_not_when_registered() -> None:
    metrics = ServerMetrics("coordinator")
    reads: list[int] = []

    def read() -> list[Gauge]:
        reads.append(1)
        return [Gauge("shardserve_test_items", "items held").add(len(reads))]

    metrics.add_collector(GaugeCollector(read))
    assert reads == []
    assert samples(metrics)[("shardserve_test_items", ())] == 1.0
    assert samples(metrics)[("shardserve_test_items", ())] == 2.0
