"""Ports for processes started on this host (server/common/ports.py): free, below the kernel's ephemeral range
(where outgoing connections and port-0 servers never land), and the kernel's choice where that range is unknown."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shardserve.server.common import ports


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_below_the_ephemeral_range_that_binds(tmp_path: Path, monkeypatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "PORT_RANGE_FILE", range_file)
    chosen = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= port < 32768 for port in chosen)
    assert len(chosen) > 1  # drawn at random, not the same one to every caller
    for port in chosen:
        _bind(port)


def test_a_taken_port_is_not_chosen(tmp_path: Path, monkeypatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{ports.LOWEST_PORT + ports.TRIES + 1} 60999\n")
    monkeypatch.setattr(ports, "PORT_RANGE_FILE", range_file)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: taken)
        port = ports.free_port()  # every draw meets the taken port: the kernel's choice
    assert port != taken
    _bind(port)


@pytest.mark.parametrize("text", [None, "", "not numbers"])
def test_without_a_readable_range_the_kernel_chooses(tmp_path: Path, monkeypatch, text) -> None:
    range_file = tmp_path / "ip_local_port_range"
    if text is not None:
        range_file.write_text(text)
    monkeypatch.setattr(ports, "PORT_RANGE_FILE", range_file)
    port = ports.free_port()
    assert port > 0
    _bind(port)
