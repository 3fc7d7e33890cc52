"""The coordinator's address, announced: `shardserve up` under PYTHONUNBUFFERED prints its `coordinator: HOST:PORT`
line whole (one write, whatever the ranks log meanwhile) and writes HOST:PORT to --address-file, atomically."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from server_helpers import TIMEOUT
from server_processes import server_env

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common import announce

START_TIMEOUT = 180.0
SHARDSERVE = str(Path(sys.executable).with_name("shardserve"))
ADDRESS = re.compile(r"coordinator: (127\.0\.0\.1:\d+)")


def test_up_writes_its_address_file_and_prints_the_line_whole(tmp_path):
    """Ranks log to the same pipe (stderr folded into stdout, info level) while the line is printed: the line
    must still parse whole, equal the file's address, and that address must answer."""
    address_file = tmp_path / "run" / "coordinator.address"
    address_file.parent.mkdir()
    address_file.write_text(
        "127.0.0.1:1\n"
    )  # a stale file from an earlier run: replaced, never read
    env = server_env(PYTHONUNBUFFERED="1", SHARDSERVE_LOG_LEVEL="INFO")
    proc = subprocess.Popen(
        [SHARDSERVE, "up", "--ranks", "1", "--state-dir", str(tmp_path / "state")]
        + ["--no-persist", "--address-file", str(address_file)],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        printed = _address_line(proc)
        assert address_file.read_text() == f"{printed}\n"
        with grpc.insecure_channel(printed) as channel:
            ranks = pb_grpc.CoordinatorStub(channel).ListRanks(
                pb.ListRanksRequest(), timeout=TIMEOUT
            )
        assert [r.rank for r in ranks.ranks if r.alive] == [0]
        assert not [p for p in address_file.parent.iterdir() if p != address_file]  # no temp left
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not address_file.exists()  # withdrawn on the way out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _address_line(proc: subprocess.Popen) -> str:
    """The address of the first output line that starts with `coordinator: `, which must be that line whole."""
    assert proc.stdout is not None
    for line in (
        proc.stdout
    ):  # bounded by the launcher's own --startup-timeout (120 s): it exits on failure
        if line.startswith("coordinator: "):
            match = ADDRESS.fullmatch(line.rstrip("\n"))
            assert match, f"a broken address line: {line!r}"
            return match.group(1)
    raise AssertionError(f"`up` ended (exit {proc.wait(timeout=30)}) without a coordinator line")


def test_the_line_goes_out_in_one_write(monkeypatch, capfd):
    """One os.write of the whole line, newline included: nothing another process writes can split it."""
    writes: list[bytes] = []
    real_write = os.write

    def recording_write(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(announce.os, "write", recording_write)
    announce.announce_address("127.0.0.1:4242")
    assert writes == [b"coordinator: 127.0.0.1:4242\n"]
    assert capfd.readouterr().out == "coordinator: 127.0.0.1:4242\n"


def test_the_address_file_is_replaced_whole(tmp_path):
    path = tmp_path / "address"
    path.write_text("old")
    announce.write_address_file(path, "10.0.0.1:50051")
    assert path.read_text() == "10.0.0.1:50051\n"
    assert [p.name for p in tmp_path.iterdir()] == ["address"]
    announce.withdraw_address(path)
    announce.withdraw_address(path)  # already gone: fine
    assert not path.exists()


@pytest.mark.parametrize("command", ["up", "coordinator"])
def test_a_missing_folder_is_a_usage_error(tmp_path, command):
    done = subprocess.run(
        [SHARDSERVE, command, "--address-file", str(tmp_path / "missing" / "address")],
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--address-file" in done.stderr, done.stderr
