"""The CLI starts without importing torch: `shardserve --help` answers at once, and a server command (`up`,
`coordinator`, `rank`, `node`) hands over to the server process without paying for a torch import first."""

from __future__ import annotations

import subprocess
import sys

from shardserve.server.rank_launch import PROJECT_ROOT


def test_the_cli_and_the_client_package_import_without_torch() -> None:
    probe = (
        "import sys, shardserve, shardserve.client, shardserve.client.cli.main; "
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(loaded[:5])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_client_package_still_answers_every_public_name() -> None:
    import shardserve.client as client

    for name in client.__all__:
        assert getattr(client, name) is not None, name
    assert client.spmd.__name__ == "shardserve.client.spmd"
