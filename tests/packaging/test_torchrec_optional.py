"""TorchRec is an optional extra: without it every shardserve module but shardserve.torchrec imports, and that one
says how to install it; only shardserve.client.torchrec imports torchrec, and only shardserve.torchrec imports
shardserve.client.torchrec.

torchrec's absence is simulated in a subprocess by a meta-path finder that refuses it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
WITHOUT_TORCHREC = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class NoTorchRec:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorchRec())
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCHREC + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )


def test_import_shardserve_torchrec_without_torchrec_says_how_to_install_it() -> None:
    result = _run(
        """
        try:
            import shardserve.torchrec
        except ImportError as err:
            print("ImportError:", err)
        else:
            print("imported")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError:"), result.stdout
    assert "pip install shardserve[torchrec]" in result.stdout


def test_every_other_module_imports_without_torchrec() -> None:
    result = _run(
        """
        failed = []
        for package in ("shardserve", "shardserve.client", "shardserve.server", "shardserve.core",
                        "shardserve.protos"):
            path = importlib.import_module(package).__path__
            for module in pkgutil.walk_packages(path, package + "."):
                if "torchrec" in module.name or module.name.endswith("__main__"):
                    continue
                try:
                    importlib.import_module(module.name)
                except Exception as err:
                    failed.append(f"{module.name}: {type(err).__name__}: {err}")
        assert "torchrec" not in sys.modules
        print("checked", len([m for m in sys.modules if m.startswith("shardserve.")]))
        for line in failed:
            print(line)
        try:
            import torchrec
        except ImportError:
            print("torchrec refused")
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "torchrec refused" and lines[:-1] == [lines[0]], result.stdout
    assert int(lines[0].split()[1]) > 100, lines[0]  # the client, server, core and protos modules


def test_only_the_torchrec_modules_import_torchrec() -> None:
    """Sources outside client/torchrec import neither torchrec nor the modules built on it (but
    shardserve/torchrec.py, which re-exports them); the import-linter contract holds the first part too."""
    allowed = {ROOT / "shardserve" / "torchrec.py"}
    importing = re.compile(
        r"^\s*(from|import)\s+(torchrec\b|fbgemm_gpu\b|shardserve\.torchrec\b|shardserve\.client\.torchrec\b)",
        re.MULTILINE,
    )
    offenders = []
    for folder in ("shardserve", "client", "server", "protos", "shardcore"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(ROOT / "client" / "torchrec") or path in allowed:
                continue
            if importing.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_extra_and_the_contract_are_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = project["project"]["optional-dependencies"]["torchrec"]
    assert any(req.startswith("torchrec==") for req in extra)
    assert any(req.startswith("fbgemm-gpu-cpu==") for req in extra)
    contracts = project["tool"]["importlinter"]["contracts"]
    forbidding = [c for c in contracts if c.get("forbidden_modules") == ["torchrec"]]
    assert forbidding and forbidding[0]["source_modules"] == ["shardserve"]
    assert "torchrec==" in (ROOT / "scripts" / "setup-venv.sh").read_text()
