"""scripts/device-cuda-check.sh's import stage: on a machine with no install of the project, the script makes
the `shardserve` import names from the checkout; here it runs with this environment's python and must import
every package pyproject lists (and start `python -m shardserve` as a child) through its own tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.slow  # imports every listed package in a fresh process

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-cuda-check.sh"


def test_check_imports_stage_imports_every_listed_package() -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--check-imports"],
        cwd=ROOT / "tests",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    listed = {
        line.split(":")[0].strip() for line in done.stdout.splitlines() if line.startswith("  ")
    }
    assert listed == set(packages)
    assert f"imports: {len(packages)} of {len(packages)} packages checked, 0 failed" in done.stdout
