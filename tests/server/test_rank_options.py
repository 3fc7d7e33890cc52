"""RankOptions: the command line a launcher gives a rank reads back as the same options (defaults, and every
field set), values out of range name their flag, and launchers number each rank's metrics port."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest

from shardserve.server.common.auth import Security
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.tracing import TRACING_ENV
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank_launch import rank_launches


def every_field_changed(persist_dir: Path) -> RankOptions:
    return RankOptions(
        listen="0.0.0.0:7000",
        advertise="rank-host:7000",
        bulk_port=7001,
        bulk_reads=False,
        device="cuda:1",
        memory_limit=1 << 30,
        max_request_bytes=4096,
        recycle_bytes=0,
        version_grace=0.25,
        persist_dir=persist_dir,
        fsync="interval",
        stall_timeout=3.5,
        streams_per_principal=3,
        dist_timeout=7.5,
        register_timeout=0.5,
        metrics_port=9100,
        tracing="file:/tmp/spans",
        log_level="DEBUG",
    )


def read_back(options: RankOptions) -> RankOptions:
    parser = argparse.ArgumentParser()
    RankOptions.add_arguments(parser)
    return RankOptions.from_args(parser.parse_args(options.to_argv()))


@pytest.fixture(autouse=True)
def no_tracing_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACING_ENV, raising=False)  # the --tracing default


def test_the_defaults_read_back_the_same() -> None:
    assert read_back(RankOptions()) == RankOptions()


def test_every_field_set_reads_back_the_same(tmp_path: Path) -> None:
    changed = every_field_changed(tmp_path / "data")
    defaults = RankOptions()
    same = [
        f.name
        for f in dataclasses.fields(RankOptions)
        if getattr(changed, f.name) == getattr(defaults, f.name)
    ]
    assert same == []  # a new field needs a value in every_field_changed
    assert read_back(changed) == changed


def test_a_relative_persist_dir_is_kept_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert RankOptions(persist_dir="data").persist_dir == str(tmp_path.resolve() / "data")
    assert RankOptions(persist_dir="").persist_dir is None


def test_ranks_log_at_this_process_level_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "level", logging.ERROR)
    assert RankOptions().log_level == "ERROR"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("memory_limit", -1, "--memory-limit must be >= 0"),
        ("recycle_bytes", -5, "--recycle-bytes must be >= 0"),
        ("bulk_port", -1, "--bulk-port must be >= 0"),
        ("version_grace", -1.0, "--version-grace must be >= 0 seconds"),
        ("dist_timeout", 0.0, "--dist-timeout must be a number of seconds > 0"),
        ("register_timeout", float("inf"), "--register-timeout must be a number"),
        ("fsync", "sometimes", "--fsync must be one of always, interval, none"),
        ("streams_per_principal", 0, "--streams-per-principal must be >= 1"),
        ("stall_timeout", 0.0, "--stall-timeout must be > 0 seconds"),
        ("tracing", "zipkin", "--tracing 'zipkin'"),
    ],
)
def test_a_value_out_of_range_names_its_flag(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankOptions(**{field: value})


def test_each_launched_rank_gets_its_metrics_port_and_the_same_settings() -> None:
    options = RankOptions(memory_limit=1 << 20, log_level="WARNING")
    launches = rank_launches(
        "127.0.0.1:5000", options, Security(), ranks=[2, 3], world_size=4, metrics_port=9000
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    RankOptions.add_arguments(parser)
    for launch, port in zip(launches, (9003, 9004)):
        args = parser.parse_args(launch.command[3:])  # past `python -m shardserve.server`
        assert args.coordinator == "127.0.0.1:5000"
        assert RankOptions.from_args(args) == dataclasses.replace(options, metrics_port=port)
        assert (launch.env["RANK"], launch.env["WORLD_SIZE"]) == (str(launch.rank), "4")


def test_a_local_cluster_sets_where_its_ranks_serve() -> None:
    with pytest.raises(ValueError, match="set per rank by the cluster"):
        LocalCluster(ranks=1, rank_options=RankOptions(metrics_port=9000))
    cluster = LocalCluster(ranks=1, host="0.0.0.0", rank_options=RankOptions(device="cuda"))
    assert cluster.rank_options == RankOptions(device="cuda", listen="0.0.0.0:0")
