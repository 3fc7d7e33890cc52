"""The distribution installs one top-level package, `shardserve`, and the generic folder names stay private."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "shardserve": "shardserve",
    "client": "shardserve.client",
    "server": "shardserve.server",
    "protos": "shardserve.protos",
    "shardcore": "shardserve.core",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
        ],
        check=True,
        timeout=240,
        cwd=out,
    )
    (built,) = out.glob("shardserve-*.whl")
    return zipfile.ZipFile(built)


def test_wheel_installs_only_shardserve(wheel):
    top = {
        name.split("/")[0]
        for name in wheel.namelist()
        if not name.split("/")[0].endswith(".dist-info")
    }
    assert top == {"shardserve"}


def test_wheel_holds_every_module_of_the_folders(wheel):
    """Every .py of the mapped folders is in the wheel under its import name (a new subpackage must be listed
    in pyproject's packages)."""
    names = set(wheel.namelist())
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            inside = path.relative_to(ROOT / folder).as_posix()
            assert f"{package.replace('.', '/')}/{inside}" in names, (
                f"{folder}/{inside} is not in the wheel"
            )
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/"))]


def test_pyproject_lists_every_package():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found == listed


def test_generic_names_are_not_importable_outside_the_repository(tmp_path):
    code = (
        "import importlib.util, sys\n"
        "from shardserve import connect, spmd, RemoteEmbedding, RemoteEmbeddingBag, TensorNotFoundError\n"
        "import shardserve.server, shardserve.core, shardserve.protos, shardserve.aio\n"
        "from shardserve import aio\n"
        "missing = [n for n in ('client', 'server', 'protos', 'shardcore', 'benchmarks')\n"
        "           if importlib.util.find_spec(n) is not None]\n"
        "print('importable:', missing)\n"
        "sys.exit(1 if missing else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("client", "server"):
        failed = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert failed.returncode == 1 and "ModuleNotFoundError" in failed.stderr


def test_nothing_inside_imports_the_top_level_package():
    """shardserve/__init__.py re-exports the client; a module of the folders importing it back would load the
    client into every server process and make a cycle."""
    offenders = []
    for folder in ("client", "server", "protos", "shardcore"):
        for path in (ROOT / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                if line.strip().startswith(("from shardserve import", "import shardserve\n")):
                    offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders
